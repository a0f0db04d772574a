"""zb1's and ZB-V's weight pass (`parallel.taps`): the shapes of a layer's tensor-parallel regions,
and the gradients of their weights from the inputs a forward recorded and the output gradients a
backward left (`parallel/pipeline.py`'s W)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from meshlm.config import ModelConfig
from meshlm.model.transformer import BLOCKS, in_order
from meshlm.parallel.rules import Layout
from meshlm.parallel.taps import Recorder, recording


def region_shapes(x: jax.ShapeDtypeStruct, layer: dict, cfg: ModelConfig, layout: Layout | None) -> tuple:
    """(inputs, outputs, weight names) of one layer's tensor-parallel regions, inputs and outputs
    as shapes in call order: what a pending weight pass of each layer keeps (zb1, `parallel.taps`),
    and the weights whose gradients the weight pass gives."""
    rec = Recorder("probe")

    def one(x, p):
        with recording(rec):
            in_order(partial(BLOCKS[cfg.family], cfg=cfg, layout=layout, remat_policy="elementwise"), x, p)

    names = []

    def one_named(x, p):
        one(x, p)
        names.extend(n for n, w in p.items() if id(w) in rec.weight_ids)

    jax.eval_shape(one_named, x, layer)
    return rec.inputs, rec.outputs, tuple(sorted(names))


def weight_gradients(stacked: dict, inputs: list, grads: list, names: tuple, cfg: ModelConfig, layout) -> dict:
    """zb1's weight pass W of a chunk of layers: the gradients of `names`, the weights its
    tensor-parallel regions use, from each region's input recorded by the forward and each output's
    gradient (the taps' gradients from B), all stacked [n, ...]. Each layer is traced with the
    regions running on the recorded inputs; the rest of it is dead code, which XLA removes."""
    block = partial(BLOCKS[cfg.family], cfg=cfg, layout=layout, remat_policy="elementwise")
    x = jnp.zeros(inputs[0].shape[1:], inputs[0].dtype)  # the first region's input: the normed stream

    def layer(_, xs):  # one loop over the layers, each differentiated on its own (nothing restacked)
        p, ins, outs = xs

        def objective(w):
            rec = Recorder("weights", inputs=ins, grads=outs)
            with recording(rec):
                in_order(block, x, {**p, **w})
            return rec.objective

        return None, jax.grad(objective)({n: p[n] for n in names})

    return jax.lax.scan(layer, None, (stacked, inputs, grads))[1]
