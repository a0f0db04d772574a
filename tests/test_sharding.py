"""Every parameter and optimizer-state leaf is sharded as the rules table says (golden tables per
strategy)."""

import pytest
from jax.sharding import PartitionSpec as P

from helpers import MESHES, build, tiny_config
from meshlm.axes import MESH_AXES
from meshlm.model.params import named_leaves
from meshlm.train_state import TrainState

# Numerical equivalence across layouts (raw gradients, SGD steps): tests/test_gradients.py.

# Golden specs: what the rules table must produce for each strategy (size-1 axes dropped).
T, F, S = "tensor", "fsdp", "stage"
GOLDEN = {
    "data8": {},  # everything replicated
    "fsdp8": {
        "wte": P(None, F),
        "wpe": P(None, F),
        "layers/wq": P(None, F),
        "layers/wk": P(None, F),
        "layers/wv": P(None, F),
        "layers/wo": P(None, None, None, F),
        "layers/w_fc": P(None, F),
        "layers/w_proj": P(None, None, F),
        "layers/ln1_scale": P(None, F),
        "layers/ln1_bias": P(None, F),
        "layers/ln2_scale": P(None, F),
        "layers/ln2_bias": P(None, F),
        "layers/bo": P(None, F),
        "layers/b_proj": P(None, F),
        "ln_f_scale": P(F),
        "ln_f_bias": P(F),
    },
    "data2_tensor4": {
        "wte": P(T),
        "layers/wq": P(None, None, T),
        "layers/wk": P(None, None, T),
        "layers/wv": P(None, None, T),
        "layers/bq": P(None, T),
        "layers/bk": P(None, T),
        "layers/bv": P(None, T),
        "layers/wo": P(None, T),
        "layers/w_fc": P(None, None, T),
        "layers/b_fc": P(None, T),
        "layers/w_proj": P(None, T),
    },
    "fsdp2_tensor4": {
        "wte": P(T, F),
        "wpe": P(None, F),
        "layers/wq": P(None, F, T),
        "layers/wk": P(None, F, T),
        "layers/wv": P(None, F, T),
        "layers/bq": P(None, T),
        "layers/bk": P(None, T),
        "layers/bv": P(None, T),
        "layers/wo": P(None, T, None, F),
        "layers/w_fc": P(None, F, T),
        "layers/b_fc": P(None, T),
        "layers/w_proj": P(None, T, F),
        "layers/ln1_scale": P(None, F),
        "layers/ln1_bias": P(None, F),
        "layers/ln2_scale": P(None, F),
        "layers/ln2_bias": P(None, F),
        "layers/bo": P(None, F),
        "layers/b_proj": P(None, F),
        "ln_f_scale": P(F),
        "ln_f_bias": P(F),
    },
    # pipeline: the stacked layer axis over `stage` (contiguous blocks); embeddings replicated over it
    "stage2_tensor4": {  # the embeddings and final norm stored split over stage (their width)
        "wte": P(T, S),
        "wpe": P(None, S),
        "ln_f_scale": P(S),
        "ln_f_bias": P(S),
        "layers/wq": P(S, None, T),
        "layers/wk": P(S, None, T),
        "layers/wv": P(S, None, T),
        "layers/bq": P(S, T),
        "layers/bk": P(S, T),
        "layers/bv": P(S, T),
        "layers/wo": P(S, T),
        "layers/w_fc": P(S, None, T),
        "layers/b_fc": P(S, T),
        "layers/w_proj": P(S, T),
        "layers/ln1_scale": P(S),
        "layers/ln1_bias": P(S),
        "layers/ln2_scale": P(S),
        "layers/ln2_bias": P(S),
        "layers/bo": P(S),
        "layers/b_proj": P(S),
    },
}
MESHES = MESHES | {"stage2_tensor4": dict(stage=2, tensor=4)}


@pytest.mark.parametrize("mesh", list(GOLDEN))
def test_param_and_optimizer_shardings_match_golden(mesh, devices):
    cfg = tiny_config("gpt", MESHES[mesh])
    _, _, _, _, state = build(cfg)
    assert isinstance(state, TrainState)
    params = named_leaves(state.params)
    for name, arr in params.items():
        want = GOLDEN[mesh].get(name, P())
        assert arr.sharding.spec == want, f"{mesh}: {name} is {arr.sharding.spec}, want {want}"
        assert arr.sharding.mesh.shape == MESHES[mesh] | {k: 1 for k in MESH_AXES if k not in MESHES[mesh]}
    # AdamW moments mirror the parameters leaf for leaf (ZeRO: sharded exactly like them).
    adam = state.opt_state[1][0]
    for moment in (adam.mu, adam.nu):
        for name, arr in named_leaves(moment).items():
            assert arr.sharding.spec == params[name].sharding.spec, f"{mesh}: optimizer {name}"
            # and really split: each device holds 1/(product of the spec's mesh axes) of the leaf
            assert arr.addressable_shards[0].data.size * _split_factor(arr) == arr.size
    assert state.step.sharding.spec == P()


def _split_factor(arr) -> int:
    n = 1
    for part in arr.sharding.spec:
        for name in (part,) if isinstance(part, str) else part or ():
            n *= arr.sharding.mesh.shape[name]
    return n


def test_every_logical_axis_has_exactly_one_rule():
    from meshlm import axes
    from meshlm.parallel.rules import RULES, rules_for

    assert set(RULES) == set(axes.PARAM_AXES) | set(axes.ACTIVATION_AXES)
    sp = dict(rules_for(True))
    # the residual's sequence: over context (CP), and under SP over context x tensor
    assert sp[axes.ACT_SEQ] == ("context", "tensor") and dict(rules_for(False))[axes.ACT_SEQ] == "context"
    assert RULES[axes.SEQ] == "context"
    # no weight is split over context: checkpoints restore on any mesh, CP or not
    assert not any("context" in str(RULES[a]) for a in axes.PARAM_AXES)
    assert {k: v for k, v in sp.items() if k != axes.ACT_SEQ} == {k: v for k, v in RULES.items() if k != axes.ACT_SEQ}
