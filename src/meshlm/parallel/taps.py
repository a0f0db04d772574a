"""Zero-bubble's split backward (zb1), at the tensor-parallel regions: B (the input gradient) and
W (the weight gradients of the matmuls) as two passes, without running the cotangent chain twice.

Every matmul weight of a layer is used inside a region - `column_parallel` (QKV, the MLP's first
projection, with their biases and the query/key norms) or `row_parallel` (the output projections)
- so the regions are where the backward splits. While a `Recorder` is active (the pipeline's
forward of a zb1 chunk, traced inside `run_layers`), each region:

- `forward`: records its input and gives each output a *tap*: an input of the vjp, never read,
  whose cotangent - which B's vjp returns - is the output's gradient, which W needs. The
  pipeline takes B's vjp with the region weights held constant, so B computes no weight gradient
  of theirs (XLA drops those GEMMs) and keeps no matmul input for one (`layers.dense`
  differentiates plainly while recording);
- `weights`: ignores the activation it is given and runs on the recorded input instead, adding
  <output, output gradient> to an objective whose gradient in the weights is exactly the
  region's weight gradients - W. The rest of the layer, traced around it, is dead code XLA drops;
- `probe`: records the shapes of inputs and outputs (what the stash for W holds per layer) and
  which weights the regions use.

What a pending W holds is thus each region's input (the residual-stream or head-sharded
activation the region was called with: sequence-sharded under SP, re-gathered by W as by the
backward of the unsplit step) and each region output's gradient. Weight gradients of anything
outside the regions (layer norms, the biases added after row-parallel outputs, MoE experts and
router) stay in B.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import jax
import jax.numpy as jnp

_ACTIVE: list[Recorder] = []


class Recorder:
    """What the regions of one layer's trace record and consume, in call order."""

    def __init__(self, mode: str, taps: Sequence = (), inputs: Sequence = (), grads: Sequence = ()):
        if mode not in ("probe", "forward", "weights"):
            raise ValueError(f"unknown recorder mode {mode!r}")
        self.mode = mode
        self._taps: Iterator = iter(taps)
        self._inputs: Iterator = iter(inputs)
        self._grads: Iterator = iter(grads)
        self.inputs: list = []  # forward: the regions' inputs; probe: their shapes
        self.outputs: list = []  # probe: the regions' outputs' shapes
        self.weight_ids: set[int] = set()  # probe: the weights the regions were given
        self.objective = jnp.zeros((), jnp.float32)

    def region(self, call: Callable, x: jax.Array, weights: Sequence[jax.Array]) -> tuple:
        if self.mode == "weights":
            outs = tuple(call(_next(self._inputs), list(weights)))
            for o in outs:
                self.objective += jnp.sum(o.astype(jnp.float32) * _next(self._grads).astype(jnp.float32))
            return outs
        outs = tuple(call(x, list(weights)))
        if self.mode == "probe":
            self.weight_ids.update(id(w) for w in weights)
            self.inputs.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
            self.outputs.extend(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs)
            return outs
        self.inputs.append(x)
        return tuple(_tapped(o, _next(self._taps)) for o in outs)

    def check_used(self) -> None:
        """Every tap (forward) or recorded input and gradient (weights) consumed: the layer's trace
        called the same regions in the same order as the probe's."""
        left = [it for it in (self._taps, self._inputs, self._grads) if next(it, None) is not None]
        if left:
            raise AssertionError("the layer called fewer tensor-parallel regions than when it was probed")


def _next(it: Iterator):
    value = next(it, None)
    if value is None:
        raise AssertionError("the layer called more tensor-parallel regions than when it was probed")
    return value


@jax.custom_vjp
def _tapped(out: jax.Array, tap: jax.Array) -> jax.Array:
    """`out`, and the gradient of `out` as the gradient of `tap` (a zero of out's shape and dtype,
    never read: the forward does no work for it, and XLA drops the zeros)."""
    return out


def _tapped_fwd(out, tap):
    return out, None


def _tapped_bwd(_, g):
    return g, g


_tapped.defvjp(_tapped_fwd, _tapped_bwd)


@contextmanager
def recording(recorder: Recorder):
    _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.pop()
    recorder.check_used()


def recording_forward() -> bool:
    """Whether a zb1 forward is being recorded (its matmuls' weights then get no gradient)."""
    return bool(_ACTIVE) and _ACTIVE[-1].mode == "forward"


def region(call: Callable, x: jax.Array, weights: Sequence[jax.Array]) -> tuple:
    """`call(x, weights)` (a region's outputs, a tuple), or what the active recorder makes of it."""
    if not _ACTIVE:
        return tuple(call(x, list(weights)))
    return _ACTIVE[-1].region(call, x, weights)
