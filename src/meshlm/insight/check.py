"""`meshlm check`: a layout proved equal to one device on the user's own configuration.

One step's raw gradients (before any optimizer: Adam and clipping hide a constant factor on a
leaf), loss and gradient norm, on the layout and on one device, from the same parameters, batch
and dropout keys, through the one gradient path the train step uses (`step.make_grad_step`).

The model is shrunk to a check size (`shrink`) that keeps everything that decides the layout's
math - family, attention kernel and block, query chunks, GQA ratio, dtype, dropout, RoPE settings,
remat policy, every mesh axis with SP, context strategy and load balancing, pipeline schedule and
virtual stages, microbatches, document masking - and cuts what does not: layers to the fewest the
layout allows, width, vocabulary and sequence to small multiples of the axis sizes and blocks.
`full=True` keeps the real sizes.

What it finds: a bug in code only the layout runs (a collective, a reduction, a region boundary, a
pipeline or ring schedule). What it cannot find: a bug in code both sides share (the model's math
itself), which the one-device reference computes the same wrong way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import jax
import numpy as np
import optax

from meshlm import accounting
from meshlm.axes import MESH_AXES
from meshlm.config import ParallelConfig, RunConfig
from meshlm.data.loader import document_segments
from meshlm.model.params import init_params, named_leaves, param_specs
from meshlm.parallel.mesh import make_layout
from meshlm.parallel.rules import reorder_sequence
from meshlm.parallel.schedules import pipeline_unit
from meshlm.step import batch_sharding, make_grad_step
from meshlm.train_state import state_shardings
from meshlm.validation import validate

# Relative error allowed per leaf (its norm), on the loss and on the gradient norm, by compute
# dtype. fp32: the layouts differ only in the order of floating-point sums; the errors seen are at
# most 1e-6 (the compatibility matrix's fp32 rows), and a doubled leaf is an error of 1. bf16: each
# side rounds activations to bf16 (unit roundoff u = 2^-8 = 3.9e-3) at points the layout moves (a
# sum split in two, a reduction in another order); the matrix's bf16 rows reach 2.4e-2 (about 6u), so
# the bound is 0.1 (about 26u): room for other shapes, and still 10x below a doubled leaf (1.0), a
# missing 1/t (at least 0.5) or a dropped pipeline stage's share.
TOLERANCES = {"float32": 1e-5, "bfloat16": 0.1}
# rows per batch shard and microbatch in the shrunk check: with one, a bug that mixes the rows of a
# device's batch (between MoE's two expert all_to_alls, say) would leave every row where it was
CHECK_ROWS = 2
STEP = 1  # the dropout key of step 1 (not 0, so that the step index really reaches the keys)
EOT = 0  # the end-of-text id of the check's random documents
CHECK_WIDTH = 64  # d_model of the shrunk model (rounded up to the fsdp axis)
CHECK_HEAD_DIM = 16
CHECK_VOCAB = 128  # rounded up to the tensor axis


@dataclass
class LeafError:
    name: str
    error: float  # relative error of the leaf as a whole (its norm)
    layer: int | None = None  # for a stacked layer leaf: the layer with the largest error


@dataclass
class CheckResult:
    layout: str
    dtype: str
    tolerance: float
    sizes: dict  # what the checked model was (shrunk or full)
    loss: tuple[float, float]  # (layout, one device)
    grad_norm: tuple[float, float]
    leaves: list[LeafError] = field(default_factory=list)  # largest error first
    note: str = ""  # how the check differs from the run (an MoE model in bf16 is checked in fp32)

    @property
    def mismatched(self) -> list[str]:
        return [e.name for e in self.leaves if not e.error <= self.tolerance]

    @property
    def loss_error(self) -> float:
        return _relative(*self.loss)

    @property
    def grad_norm_error(self) -> float:
        return _relative(*self.grad_norm)

    @property
    def equal(self) -> bool:
        return not self.mismatched and self.loss_error <= self.tolerance and self.grad_norm_error <= self.tolerance


def _relative(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def shrink(cfg: RunConfig) -> RunConfig:
    """The check-size config: the layout's math kept, its sizes cut (see the module)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.stage > 1:  # two slots per pipeline chunk (the scan inside a chunk, its slicing), when it has two
        chunks, unit = p.stage * p.virtual_stages, pipeline_unit(m)  # (and a dense first layer, run with the embedding)
        slots = chunks * min(2, unit.count // chunks)
        if unit.count % chunks:  # uneven stages stay uneven (a pad slot)
            slots += 1 if slots == chunks else -1
        layers = slots * len(unit.kinds) + (1 if unit.prefix else 0)
    else:  # a partial unroll stays partial; chained layers (unroll >= layers) stay chained
        layers = min(m.n_layers, m.scan_unroll + 1 if 1 < m.scan_unroll < m.n_layers else 2)
        # one layer of the first kind, then the other's scan: one more keeps its unroll partial
        layers += 1 if m.dense_layer_ids and 1 < m.scan_unroll < m.n_layers else 0
    group = m.n_heads // m.kv_heads  # query heads per kv head (GQA), kept
    kv = p.tensor * (p.context if p.context_strategy == "all_to_all" else 1)  # the fewest kv heads the mesh splits
    seq = _check_seq_len(cfg)
    model = dataclasses.replace(
        accounting.with_layers(m, layers, units=p.stage > 1),
        n_heads=kv * group,
        n_kv_heads=kv if group > 1 else 0,
        head_dim=CHECK_HEAD_DIM,
        d_model=math.lcm(CHECK_WIDTH, p.fsdp),
        d_ff=0,
        vocab_size=math.lcm(CHECK_VOCAB, p.tensor),
        max_seq_len=max(seq, m.max_seq_len) if m.family == "llama" else seq,
        scan_unroll=m.scan_unroll if m.scan_unroll < m.n_layers else layers,
    )
    if m.mla:  # keys and values per query head; its ranks and head parts cut, values still not q/k-sized
        h = CHECK_HEAD_DIM
        ranks = dict(kv_lora_rank=h, q_lora_rank=h if m.q_lora_rank else 0, v_head_dim=h // 2)
        model = dataclasses.replace(
            model, n_kv_heads=0, head_dim=0, qk_nope_head_dim=h // 2, qk_rope_head_dim=h // 2, **ranks
        )
    rows = CHECK_ROWS * t.microbatches * p.batch_shards
    train = dataclasses.replace(t, seq_len=seq, global_batch=rows, steps=max(t.steps, STEP))
    return dataclasses.replace(cfg, model=model, train=train)


def _check_seq_len(cfg: RunConfig) -> int:
    """The shortest sequence that keeps the kernel's structure: two attention blocks (or explicit
    attention's query chunks) at least, whole context chunks of whole blocks, a multiple of the SP
    split; the run's own sequence when that is shorter (it meets the same rules)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    blockwise = m.attention != "explicit" or (p.context > 1 and p.context_strategy != "all_to_all")
    unit = p.context_chunks * (m.attention_block if blockwise else 1)
    if p.sequence_parallel:
        unit = math.lcm(unit, p.context * p.tensor)
    want = 2 * (m.attention_block if blockwise else (m.attention_chunk or 16))
    seq = unit * math.ceil(want / unit)
    return min(seq, t.seq_len)


def reference_config(cfg: RunConfig) -> RunConfig:
    """The same run on one device: no mesh axis, no SP; microbatches, dropout and masks kept. Under
    context parallelism the attention kernel's block is the one the context ranks run (at most one
    context chunk, `parallel.context.kernel_block`): dropout masks are drawn per block, so a larger
    block on one device would draw other (equally valid) bits, not find a bug."""
    ref = dataclasses.replace(cfg, parallel=ParallelConfig())
    if cfg.parallel.context > 1 and cfg.parallel.context_strategy != "all_to_all":  # Ulysses: the run's own block
        block = min(cfg.model.attention_block, cfg.train.seq_len // cfg.parallel.context_chunks)
        ref = dataclasses.replace(ref, model=dataclasses.replace(ref.model, attention_block=block))
    return ref


def check_params(cfg: RunConfig, seed: int = 0) -> dict:
    """Host parameters for the check: the model's initialisation, perturbed so that norms and biases
    are not 1 and 0 (else their gradients hide mistakes)."""
    params = init_params(param_specs(cfg.model), jax.random.key(seed))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noisy = [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return jax.device_get(jax.tree.unflatten(tree, noisy))


def check_batch(cfg: RunConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """A random global batch in the original sequence order; with document masking, an end-of-text
    every 7 tokens, so the masks really cut attention; with a loss mask, a random one."""
    rng = np.random.default_rng(seed)
    shape = (cfg.train.global_batch, cfg.train.seq_len + 1)
    tokens = rng.integers(1, cfg.model.vocab_size, shape).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if cfg.data.document_mask:
        batch["inputs"][:, ::7] = EOT
        batch |= document_segments(batch["inputs"], EOT)
    if cfg.data.loss_mask:  # packed chat rows: about 60% of the targets trained, row 0's second half none
        batch["mask"] = (rng.random(batch["targets"].shape) < 0.6).astype(np.int32)
        batch["mask"][0, batch["mask"].shape[1] // 2 :] = 0
    return batch


def source_params(cfg: RunConfig, init_from: str) -> dict:
    """`--init-from`'s weights as host arrays of `cfg`'s model: what `check --full --init-from`
    checks on (the loader `train --init-from` uses, `sources.source_params`)."""
    from meshlm.model.params import abstract_params
    from meshlm.sources import source_params as load
    from meshlm.train_state import param_shardings

    layout = make_layout(ParallelConfig(), [jax.local_devices()[0]])
    specs = param_specs(cfg.model)
    place = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    abstract = jax.tree.map(place, abstract_params(specs), param_shardings(specs, layout))
    return jax.device_get(load(init_from, cfg, abstract)[0])


def gradients(cfg: RunConfig, params: dict, batch: dict, devices: list) -> dict:
    """{"grads", "loss", "grad_norm"} of `cfg`'s gradient path on `devices`, as host arrays."""
    layout = make_layout(cfg.parallel, devices)
    shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
    if layout.context_size > 1:  # the loader's storage order (load-balanced chunks)
        batch = {k: reorder_sequence(v, layout.context_order) for k, v in batch.items()}
    batch = jax.device_put(batch, batch_sharding(layout))  # every process holds the whole host batch
    out = make_grad_step(cfg, layout, shardings)(jax.device_put(params, shardings), batch, STEP)
    return jax.tree.map(_to_host, out)


def _to_host(x: jax.Array) -> np.ndarray:
    """A global array's whole value on this host: gathered over the processes when the layout spans
    several (multi-process `train --check`), else read (the one-device reference is local)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def leaf_errors(got: dict, ref: dict) -> list[LeafError]:
    """Each leaf's relative error (the norm of the difference over the leaf's norm), largest first.
    A leaf whose exact value is zero holds rounding noise only (gpt's key bias: softmax ignores a
    constant added to a whole row of scores), so the scale is at least 1e-3 of the whole tree's norm.
    For a stacked layer leaf [L, ...], the layer with the largest error is named."""
    g, r = named_leaves(got), named_leaves(ref)
    if g.keys() != r.keys():
        raise ValueError(f"the two gradient trees differ: {sorted(g.keys() ^ r.keys())}")
    floor = 1e-3 * float(np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in r.values())))
    out = []
    for name in r:
        a, b = np.asarray(g[name], np.float64), np.asarray(r[name], np.float64)
        error = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor))
        layer = None
        if name.startswith("layers/") and b.ndim > 1 and b.shape[0] > 1:
            per = np.linalg.norm((a - b).reshape(b.shape[0], -1), axis=1)
            layer = int(np.argmax(per))
        out.append(LeafError(name, error, layer))
    return sorted(out, key=lambda e: -e.error)


def run_check(cfg: RunConfig, *, full: bool = False, params: dict | None = None, devices: list | None = None):
    """Check `cfg`'s layout against one device (shrunk unless `full`); `params` (host arrays of the
    checked model's shapes) default to `check_params`. Raises ConfigError for a config that cannot run."""
    checked = validate(cfg) if full else validate(shrink(validate(cfg)))  # the user's config is judged first
    note = ""
    if checked.model.moe and checked.model.dtype != "float32":
        # Routing is discontinuous: bf16 activations round differently on another layout (XLA:CPU's
        # bf16 forward is not bitwise the same at another batch size, dense models included), and a
        # near-tied router logit then sends a token to another expert - both runs right, their
        # gradients far apart. The layout's math is dtype-independent: check it in fp32.
        checked = dataclasses.replace(checked, model=dataclasses.replace(checked.model, dtype="float32"))
        note = (
            f"an MoE model in {cfg.model.dtype} is checked in float32: its routing is discontinuous, so "
            "rounding that differs between layouts can send a near-tied token to another expert"
        )
    ref_cfg = validate(reference_config(checked))
    n = checked.parallel.n_devices
    devices = list(jax.devices() if devices is None else devices)
    if n > len(devices):
        from meshlm.config import ConfigError

        raise ConfigError(
            f"the layout needs {n} devices but {len(devices)} are available (on CPU: --devices {n} simulates them)"
        )
    params = check_params(checked, checked.train.seed) if params is None else params
    batch = check_batch(checked, checked.train.seed)
    got = gradients(checked, params, batch, devices[:n])
    want = gradients(ref_cfg, params, batch, [jax.local_devices()[0]])
    m = checked.model
    sizes = {k: getattr(m, k) for k in ("family", "n_layers", "d_model", "n_heads", "kv_heads", "vocab_size")}
    sizes |= {"seq_len": checked.train.seq_len, "global_batch": checked.train.global_batch, "shrunk": not full}
    return CheckResult(
        layout=_describe(checked),
        dtype=m.dtype,
        tolerance=TOLERANCES[m.dtype],
        sizes=sizes,
        loss=(float(got["loss"]), float(want["loss"])),
        grad_norm=(float(got["grad_norm"]), float(want["grad_norm"])),
        leaves=leaf_errors(got["grads"], want["grads"]),
        note=note,
    )


def _describe(cfg: RunConfig) -> str:
    p, m = cfg.parallel, cfg.model
    mesh = ",".join(f"{a}={getattr(p, a)}" for a in MESH_AXES if getattr(p, a) > 1) or "one device"
    parts = [mesh]
    if p.sequence_parallel:
        parts.append("SP")
    if p.context > 1:
        parts.append(f"context {p.context_strategy}" + ("" if p.context_load_balance else " unbalanced"))
    if p.stage > 1:
        parts.append(p.pipeline_schedule + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else ""))
        parts[-1] += " single ticks" if p.pipeline_ticks == "single" else ""
    parts += [m.attention, f"remat {cfg.remat.policy}", m.dtype]
    if cfg.train.microbatches > 1:
        parts.append(f"{cfg.train.microbatches} microbatches")
    if cfg.data.document_mask:
        parts.append("document masks")
    if cfg.data.loss_mask:
        parts.append("loss mask")
    if m.dropout:
        parts.append(f"dropout {m.dropout:g}")
    return " | ".join(parts)


def format_result(r: CheckResult, top: int = 8) -> list[str]:
    """The check as text: what was compared, the worst leaves, the loss and norm, the verdict."""
    size = "shrunk to " if r.sizes["shrunk"] else ""
    s = r.sizes
    lines = [
        f"meshlm check: {r.layout}",
        f"  model {size}{s['family']} L={s['n_layers']} h={s['d_model']} a={s['n_heads']} kv={s['kv_heads']} "
        f"v={s['vocab_size']}, batch {s['global_batch']} x {s['seq_len']} tokens",
        f"  tolerance {r.tolerance:g} relative ({r.dtype})" + (f"; {r.note}" if r.note else ""),
        f"  loss       layout {r.loss[0]:.8g}  one device {r.loss[1]:.8g}  relative difference {r.loss_error:.2e}",
        f"  grad norm  layout {r.grad_norm[0]:.8g}  one device {r.grad_norm[1]:.8g}  "
        f"relative difference {r.grad_norm_error:.2e}",
        "  largest relative error per parameter:",
    ]
    shown = [e for e in r.leaves if e.name in r.mismatched] or r.leaves[:top]
    for e in shown[: max(top, len(r.mismatched))]:
        where = f" (layer {e.layer})" if e.layer is not None and e.name in r.mismatched else ""
        lines.append(f"    {e.name:24s} {e.error:.2e}{'  MISMATCH' if e.name in r.mismatched else ''}{where}")
    if r.equal:
        lines.append(f"verdict: equal to one device ({len(r.leaves)} parameters, loss and gradient norm)")
    else:
        what = ", ".join(r.mismatched) or "the loss or gradient norm"
        lines.append(f"verdict: DIFFERS from one device: {what}")
    return lines


def to_json(r: CheckResult) -> dict:
    return {
        "verdict": "equal" if r.equal else "differs",
        "layout": r.layout,
        "dtype": r.dtype,
        "tolerance": r.tolerance,
        "model": r.sizes,
        "loss": {"layout": r.loss[0], "one_device": r.loss[1], "relative_difference": r.loss_error},
        "grad_norm": {"layout": r.grad_norm[0], "one_device": r.grad_norm[1], "relative_difference": r.grad_norm_error},
        "parameters": [{"name": e.name, "relative_error": e.error, "layer": e.layer} for e in r.leaves],
        "mismatched": r.mismatched,
        "note": r.note,
    }
