"""Layout equivalence on raw gradients: every layout, remat policy, document masking and gradient
accumulation gives the gradient one device gives, before the optimizer.

Why gradients and not losses or parameters after a few AdamW steps: Adam divides each leaf's
update by that leaf's own gradient scale and global-norm clipping rescales them all, so a doubled
psum or a missing 1/t on one leaf leaves the updates (and the losses) unchanged. Here every leaf
is compared on its own (relative error of the leaf as a whole, fp32), together with the loss and
the global gradient norm; `test_an_injected_factor_of_two_fails` shows such a bug being caught.
The one multi-step test uses plain SGD, whose updates are proportional to the gradient.
"""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from helpers import MESHES, loss_mask, random_batches, tiny_config
from meshlm.config import RematConfig, RunConfig
from meshlm.data.loader import document_segments
from meshlm.model.params import init_params, named_leaves, param_specs
from meshlm.parallel.mesh import make_layout
from meshlm.parallel.remat import POLICIES
from meshlm.parallel.rules import reorder_sequence
from meshlm.step import make_grad_step, make_train_step
from meshlm.train_state import init_state, state_shardings

# fp32 on CPU: layouts differ only in summation order. Observed relative errors per leaf are
# below 1e-6 (3e-7 to 8e-7); a factor of 2 on a leaf is an error of 1.
RTOL = 1e-5
LAYOUTS = {
    "data8": (MESHES["data8"], False),
    "fsdp8": (MESHES["fsdp8"], False),
    "data2_tensor4": (MESHES["data2_tensor4"], False),
    "fsdp2_tensor4": (MESHES["fsdp2_tensor4"], False),
    "data2_tensor4+sp": (MESHES["data2_tensor4"], True),
    "fsdp2_tensor4+sp": (MESHES["fsdp2_tensor4"], True),
}
STEP = 5  # the dropout key of step 5: a step other than 0, so the step index really reaches it
EOT = 0


def config(family: str, layout: str = "single", *, policy="elementwise", document_mask=False, **train) -> RunConfig:
    mesh, sp = LAYOUTS[layout] if layout != "single" else ({}, False)
    cfg = tiny_config(family, mesh, **train)
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, sequence_parallel=sp),
        remat=RematConfig(policy),
        data=dataclasses.replace(cfg.data, document_mask=document_mask),
    )


def batch_for(cfg: RunConfig) -> dict[str, np.ndarray]:
    """A random batch; with document masks, packed as chat data is: several documents per row (so
    the masks really cut attention) and a loss mask (about 60% of the targets trained, none in
    half a row), so every document-masked layout test is a loss-masked one too."""
    batch = random_batches(cfg, 1, seed=3)[0]
    if cfg.data.document_mask:
        batch["inputs"][:, ::7] = EOT
        batch |= document_segments(batch["inputs"], EOT)
        batch["mask"] = loss_mask(batch["targets"].shape)
    return batch


@pytest.fixture(scope="module")
def params():
    """One set of fp32 parameters per family (perturbed so norms and biases are not 1 and 0)."""
    out = {}
    for family in ("gpt", "llama"):
        specs = param_specs(config(family).model)
        p = init_params(specs, jax.random.key(0))
        leaves, tree = jax.tree.flatten(p)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        out[family] = jax.tree.unflatten(
            tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
        )
    return jax.device_get(out)


def grads(cfg: RunConfig, params: dict, reorder: bool = True) -> dict:
    """Raw gradients of the train step's gradient path at STEP. With context parallelism the batch
    is put in the layout's storage order, as the loader does (not with `reorder=False`)."""
    layout = make_layout(cfg.parallel, jax.devices()[: cfg.parallel.n_devices])
    shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
    batch = batch_for(cfg)
    if reorder and layout.context_size > 1:
        batch = {k: reorder_sequence(v, layout.context_order) for k, v in batch.items()}
    fn = make_grad_step(cfg, layout, shardings)
    return jax.device_get(fn(jax.device_put(params, shardings), batch, STEP))


@pytest.fixture(scope="module")
def reference(params):
    """Single-device gradients, computed once per (family, document mask, microbatches)."""
    cache = {}

    def get(family: str, document_mask: bool = False, microbatches: int = 1) -> dict:
        key = (family, document_mask, microbatches)
        if key not in cache:
            cfg = config(family, document_mask=document_mask, microbatches=microbatches)
            cache[key] = grads(cfg, params[family])
        return cache[key]

    return get


def assert_leaves_close(got: dict, ref: dict, rtol: float, what: str) -> None:
    """Each leaf of `got` within `rtol` of `ref`'s, relative to the leaf's norm. A leaf whose exact
    value is zero holds rounding noise only (the gradient of gpt's key bias: softmax ignores a
    constant added to a whole row of scores), so the scale is at least 1e-3 of the whole tree's
    norm (every other leaf is above that here)."""
    g, r = named_leaves(got), named_leaves(ref)
    assert g.keys() == r.keys()
    floor = 1e-3 * float(np.sqrt(sum(np.sum(np.square(x)) for x in r.values())))
    errors = {n: float(np.linalg.norm(g[n] - r[n]) / max(np.linalg.norm(r[n]), floor)) for n in r}
    bad = {n: round(e, 4) for n, e in errors.items() if not e <= rtol}
    assert not bad, f"{what} differ from one device (relative error per leaf): {bad}"


def assert_same_grads(got: dict, ref: dict) -> None:
    assert_leaves_close(got["grads"], ref["grads"], RTOL, "gradient leaves")
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-6)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=RTOL)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", ["gpt", "llama"])  # gpt with dropout 0.1 everywhere, llama with GQA
def test_every_layout_gives_the_one_device_gradients(family, layout, params, reference):
    assert_same_grads(grads(config(family, layout), params[family]), reference(family))


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "elementwise"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_every_remat_policy_gives_the_one_device_gradients(family, policy, params, reference):
    """Recomputation (under SP, dropout masks replayed) changes no gradient."""
    cfg = config(family, "data2_tensor4+sp", policy=policy)
    assert_same_grads(grads(cfg, params[family]), reference(family))


@pytest.mark.parametrize("layout", ["fsdp8", "data2_tensor4+sp"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_document_masking_gradients_on_every_layout(family, layout, params, reference):
    got = grads(config(family, layout, document_mask=True), params[family])
    ref = reference(family, document_mask=True)
    assert_same_grads(got, ref)
    assert not np.allclose(ref["loss"], reference(family)["loss"], rtol=1e-3)  # the mask really acts


@pytest.mark.parametrize("layout", ["fsdp2_tensor4", "data2_tensor4+sp"])
def test_accumulated_gradients_on_every_layout(layout, params, reference):
    """4 microbatches (dropout key per microbatch) sharded = 4 microbatches on one device."""
    assert_same_grads(grads(config("gpt", layout, microbatches=4), params["gpt"]), reference("gpt", microbatches=4))


def test_accumulation_equals_the_whole_batch(params, reference):
    """Without dropout (whose bits depend on the microbatch), k microbatches are the whole batch."""
    assert_same_grads(grads(config("llama", microbatches=4), params["llama"]), reference("llama"))


def _scale_gradient(x: jax.Array, factor: float) -> jax.Array:
    @jax.custom_vjp
    def identity(x):
        return x

    identity.defvjp(lambda x: (x, None), lambda _, g: (g * factor,))
    return identity(x)


def test_an_injected_factor_of_two_fails(monkeypatch, params, reference):
    """The test's power: a doubled gradient on one leaf, on tensor-parallel layouts only (like a
    psum applied twice), leaves the loss untouched and is caught, naming the leaf."""
    from meshlm.model import transformer

    real = transformer.row_parallel

    def doubled(layout, equation, x, w, *rest, **kw):
        if equation == "btnh,nhd->btd" and layout is not None and layout.tensor_size > 1:  # wo only
            w = _scale_gradient(w, 2.0)
        return real(layout, equation, x, w, *rest, **kw)

    monkeypatch.setattr(transformer, "row_parallel", doubled)
    got, ref = grads(config("gpt", "data2_tensor4"), params["gpt"]), reference("gpt")
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-6)  # a loss comparison passes
    with pytest.raises(AssertionError, match=r"per leaf\): \{'layers/wo': 1\.0\}"):
        assert_same_grads(got, ref)


def assert_sgd_steps_equal(reference_cfg: RunConfig, cfg: RunConfig, params: dict) -> None:
    """Five steps of plain SGD (no warmup, no clipping, no Adam normalisation) from `params` on one
    memorised batch: the losses and parameter changes of `cfg` equal `reference_cfg`'s. The update
    is proportional to each leaf's gradient, so the parameters see any scale error, compounded."""
    tx = optax.sgd(1.0)
    batches = random_batches(reference_cfg, 1, seed=4) * 5

    def train(cfg):
        layout_ = make_layout(cfg.parallel, jax.devices()[: cfg.parallel.n_devices])
        shardings = state_shardings(param_specs(cfg.model), layout_, tx)
        state = init_state(param_specs(cfg.model), layout_, tx, 0)
        state = state._replace(params=jax.device_put(params, shardings.params))
        step = make_train_step(cfg, layout_, tx, shardings)
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        return losses, jax.device_get(state.params)

    ref_losses, ref_params = train(reference_cfg)
    losses, got = train(cfg)
    assert ref_losses[-1] < ref_losses[0] - 0.2, ref_losses  # the steps really train
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    moved = lambda p: jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), p, params)
    assert_leaves_close(moved(got), moved(ref_params), 1e-4, "parameter changes after 5 SGD steps")


@pytest.mark.parametrize("family, layout", [("gpt", "fsdp2_tensor4+sp"), ("llama", "data2_tensor4")])
def test_sgd_steps_equal_one_device(family, layout, params):
    assert_sgd_steps_equal(config(family), config(family, layout), params[family])


def test_step_and_grad_step_share_one_gradient(params):
    """The train step applies its optimizer to exactly `make_grad_step`'s gradients: one SGD step
    of rate 1 from the same parameters moves each leaf by minus that gradient."""
    cfg = config("gpt", "data2_tensor4+sp")
    layout = make_layout(cfg.parallel)
    tx = optax.sgd(1.0)
    shardings = state_shardings(param_specs(cfg.model), layout, tx)
    state = init_state(param_specs(cfg.model), layout, tx, 0)
    state = state._replace(
        params=jax.device_put(params["gpt"], shardings.params), step=jax.device_put(np.int32(STEP), shardings.step)
    )
    new, _ = make_train_step(cfg, layout, tx, shardings)(state, batch_for(cfg))
    g = grads(cfg, params["gpt"])["grads"]
    moved = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params["gpt"], jax.device_get(new.params))
    for name, d in named_leaves(moved).items():
        np.testing.assert_allclose(d, named_leaves(g)[name], rtol=1e-5, atol=1e-7, err_msg=name)


_BLOCKWISE_REF: dict = {}


@pytest.mark.parametrize("layout", ["fsdp8", "data2_tensor4+sp"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_blockwise_attention_gradients_on_every_layout(family, layout, params, reference):
    """`model.attention=blockwise` (block 8: several blocks, causal block skipping, document masks;
    gpt's dropout masks drawn and replayed block by block) gives one device's gradients on sharded
    layouts with and without SP; without dropout (llama) they are explicit attention's."""

    def blockwise(lay):
        cfg = config(family, lay, document_mask=True)
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="blockwise", attention_block=8))

    if family not in _BLOCKWISE_REF:
        _BLOCKWISE_REF[family] = grads(blockwise("single"), params[family])
    ref = _BLOCKWISE_REF[family]
    assert_same_grads(grads(blockwise(layout), params[family]), ref)
    if family == "llama":
        assert_same_grads(ref, reference(family, document_mask=True))
