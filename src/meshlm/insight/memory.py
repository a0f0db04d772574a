"""Measure the activation bytes a configuration keeps for its backward pass, per device: the
residuals of `jax.vjp` of the forward pass and loss, in a program compiled for the measurement
(not the train step's peak memory; see docs/memory.md).

P2's "activations" are the forward tensors the backward pass needs. In JAX those are exactly the
residuals of `jax.vjp`: the leaves of the returned vjp function. We jit a function that returns
them, with the model's real shardings, and read each leaf's per-device size from the compiled
program's output shardings. XLA's own count, `memory_analysis().output_size_in_bytes`, equals their
sum (parameters included) up to a few hundred bytes of tuple overhead; a test holds it to that.
Residuals that do not grow with the batch - the parameters and their compute-dtype copies, causal
masks, RoPE tables - are not activations and are excluded: a leaf counts when its global size
grows with the batch (found by tracing the same function at batch 2b; most double, a grouped MoE
buffer's tile padding does not).

Nothing is executed and no parameter is materialised: inputs are abstract, so even paper-scale
configurations can be measured where they compile.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from meshlm import accounting
from meshlm import axes as ax
from meshlm.config import RematConfig, RunConfig
from meshlm.model import mixed
from meshlm.model.params import abstract_params, param_specs, partition, trainable_mask
from meshlm.parallel.mesh import make_layout
from meshlm.parallel.remat import POLICIES
from meshlm.parallel.rules import Layout
from meshlm.step import objective_sum
from meshlm.train_state import param_shardings
from meshlm.validation import validate


@dataclass(frozen=True)
class Residual:
    label: str  # "per layer (stacked)" or "outside the layers"
    shape: tuple[int, ...]  # global shape
    dtype: str
    device_bytes: int  # bytes one device holds (0 when offloaded to host memory)
    host_bytes: int  # bytes held in host memory per device (offload policies)


@dataclass
class Measurement:
    activation_bytes: int  # per device, device memory only
    host_bytes: int  # per device, offloaded to host memory
    residuals: list[Residual] = field(default_factory=list)
    residual_bytes: int = 0  # per device, every residual leaf (parameters and constants included)
    compiled_output_bytes: int = 0  # XLA's memory_analysis of the same outputs


def _residual_fn(cfg: RunConfig, layout: Layout):
    key = jax.random.key(0) if cfg.model.stochastic else None

    mask = trainable_mask(param_specs(cfg.model))

    def residuals(params, inputs, targets):
        trainable, frozen, join = partition(params, mask)  # LoRA: only the adapters, as `step.gradients`

        def loss(t):  # the train step's objective (MoE: with the router losses)
            return objective_sum(join(t, frozen), {"inputs": inputs, "targets": targets}, cfg, layout, key)[0]

        _, vjp_fn = jax.vjp(loss, trainable)
        return jax.tree.leaves(vjp_fn)

    return residuals


def measure_activations(cfg: RunConfig, layout: Layout, batch: int | None = None) -> Measurement:
    """Per-device bytes of the activations stored for backward, with a per-tensor breakdown."""
    b = batch or cfg.train.global_batch // cfg.train.microbatches
    s = cfg.train.seq_len
    specs = param_specs(cfg.model)
    p_abs = abstract_params(specs)
    p_shard = param_shardings(specs, layout)
    tok_shard = layout.sharding((ax.BATCH, ax.SEQ))
    fn = _residual_fn(cfg, layout)

    def tokens(n):
        return jax.ShapeDtypeStruct((n, s), jnp.int32)

    jitted = jax.jit(fn, in_shardings=(p_shard, tok_shard, tok_shard))
    compiled = jitted.lower(p_abs, tokens(b), tokens(b)).compile()
    shapes_b = jax.eval_shape(fn, p_abs, tokens(b), tokens(b))
    shapes_2b = jax.eval_shape(fn, p_abs, tokens(2 * b), tokens(2 * b))
    assert len(shapes_b) == len(shapes_2b), "residual structure changed with the batch size"
    per_layer = _stacked_leaves(cfg, layout, shapes_b, b, s)

    residuals, total_dev, total_host, all_bytes = [], 0, 0, 0
    for i, (sb, s2b, sharding) in enumerate(zip(shapes_b, shapes_2b, compiled.output_shardings, strict=True)):
        nbytes = device_bytes(sb, sharding)
        all_bytes += nbytes
        if math.prod(s2b.shape) <= math.prod(sb.shape):
            continue  # does not grow with the batch: a parameter or a constant
        on_host = getattr(sharding, "memory_kind", None) == "pinned_host"
        label = "per layer (stacked)" if i in per_layer else "outside the layers"
        residuals.append(
            Residual(label, tuple(sb.shape), str(sb.dtype), 0 if on_host else nbytes, nbytes if on_host else 0)
        )
        total_dev += 0 if on_host else nbytes
        total_host += nbytes if on_host else 0
    analysis = compiled.memory_analysis()
    out_bytes = int(getattr(analysis, "output_size_in_bytes", all_bytes)) if analysis is not None else all_bytes
    residuals.sort(key=lambda r: -(r.device_bytes + r.host_bytes))
    return Measurement(total_dev, total_host, residuals, all_bytes, out_bytes)


def device_bytes(abstract, sharding) -> int:
    """Bytes one device holds of an array with this global shape/dtype and sharding."""
    is_key = jax.dtypes.issubdtype(abstract.dtype, jax.dtypes.prng_key)
    itemsize = 8 if is_key else np.dtype(abstract.dtype).itemsize  # a threefry key is 2 x uint32
    return math.prod(sharding.shard_shape(abstract.shape)) * itemsize


def _stacked_leaves(cfg: RunConfig, layout: Layout, shapes, b: int, s: int) -> set[int]:
    """Indices of residuals stacked over layers: their leading dim grows with n_layers (an MoE model
    with dense layers: with every scan's repeats doubled, the same scans over more layers)."""
    m = cfg.model
    deeper_m = dataclasses.replace(m, n_layers=m.n_layers + 1)
    if m.dense_layer_ids:
        groups = mixed.layer_groups(m.moe_layer_ids, m.n_layers)
        kinds = [kind for unit, r in groups for kind in unit * (2 * r)]
        dense = tuple(i for i, kind in enumerate(kinds) if not kind)
        deeper_m = dataclasses.replace(m, n_layers=len(kinds), first_k_dense=0, moe_layer_step=1, dense_layers=dense)
        if [u for u, _ in mixed.layer_groups(deeper_m.moe_layer_ids, len(kinds))] != [u for u, _ in groups]:
            return set()  # the greedy grouping found other units: no labels (the totals do not need them)
    deeper = dataclasses.replace(cfg, model=deeper_m)
    tokens = jax.ShapeDtypeStruct((b, s), jnp.int32)
    two = jax.eval_shape(_residual_fn(deeper, layout), abstract_params(param_specs(deeper.model)), tokens, tokens)
    return {i for i, (x, y) in enumerate(zip(shapes, two, strict=True)) if x.shape != y.shape}


@dataclass
class MemoryRow:
    policy: str
    sequence_parallel: bool
    formula: dict  # accounting.activation_memory
    measured: Measurement | None

    @property
    def ratio(self) -> float | None:
        if self.measured is None or not self.formula["total"]:
            return None
        return self.measured.activation_bytes / self.formula["total"]


def memory_table(cfg: RunConfig, *, measure: bool = True, devices: list | None = None) -> list[MemoryRow]:
    """Every remat policy x sequence parallelism on/off (on only where tensor > 1): formula bytes
    from `accounting.activation_memory`, and measured bytes when `measure`."""
    rows = []
    for policy in POLICIES:
        for sp in (False, True) if cfg.parallel.tensor > 1 else (False,):
            c = dataclasses.replace(
                cfg,
                parallel=dataclasses.replace(cfg.parallel, sequence_parallel=sp),
                remat=RematConfig(policy=policy),
            )
            validate(c)
            formula = accounting.activation_memory(c)
            measured = measure_activations(c, make_layout(c.parallel, devices)) if measure else None
            rows.append(MemoryRow(policy, sp, formula, measured))
    return rows
