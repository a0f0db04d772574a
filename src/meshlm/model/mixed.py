"""MoE models whose layers are not all MoE: DeepSeek's first dense layers (`model.first_k_dense`),
Qwen's `decoder_sparse_step` and `mlp_only_layers` (`model.moe_layer_step`, `dense_layers`).

A `lax.scan` carries one kind of layer, so the two kinds are stacked apart: `params["layers"]`
holds the MoE layers and `params["dense_layers"]` the dense ones, each in model order. The model
runs its layers in order as a few scans, one per run of a repeated unit (`layer_groups`): DeepSeek-V3's
61 layers are 3 dense, then 58 MoE (two scans of one layer each); Qwen's decoder_sparse_step=2 is
(dense, MoE) x L/2 (one scan over pairs). Each layer keeps its own index for its dropout key and
its KV cache slot, and the remat policy wraps each layer, as `transformer.run_layers` does.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

MAX_UNIT = 4  # the longest repeated unit of layers looked for


def layer_groups(moe_ids: tuple[int, ...], n_layers: int) -> list[tuple[tuple[bool, ...], int]]:
    """The layers in order as (unit of layer kinds, True = MoE; repeats), greedily from the first
    layer: the unit covering the most layers, a longer unit only if it repeats."""
    kinds = tuple(i in set(moe_ids) for i in range(n_layers))
    groups, i = [], 0
    while i < n_layers:
        best = (kinds[i : i + 1], 1)
        for u in range(1, MAX_UNIT + 1):
            unit = kinds[i : i + u]
            if len(unit) < u:
                break
            r = 1
            while kinds[i + r * u : i + (r + 1) * u] == unit:
                r += 1
            if (r > 1 or u == 1) and r * u > len(best[0]) * best[1]:
                best = (unit, r)
        groups.append(best)
        i += len(best[0]) * best[1]
    return groups


def run(carry, params: dict, moe_ids: tuple[int, ...], n_layers: int, one_layer: Callable, unroll: int = 1):
    """Every layer in model order: `one_layer(carry, layer params, layer index)` -> (carry, output
    or None), over `params["dense_layers"]` and `params["layers"]` (the MoE layers). Returns (carry,
    the MoE layers' outputs stacked [n MoE layers, ...] in order, or None when they have none)."""
    taken = {"dense_layers": 0, "layers": 0}
    outputs = []
    for unit, repeats in layer_groups(moe_ids, n_layers):
        first = sum(taken.values())
        xs = {}
        for stack, kind in (("dense_layers", False), ("layers", True)):
            per = unit.count(kind)
            if per:
                part = jax.tree.map(lambda a, k=taken[stack], n=per * repeats: a[k : k + n], params[stack])
                xs[stack] = jax.tree.map(lambda a, n=per, r=repeats: a.reshape(r, n, *a.shape[1:]), part)
                taken[stack] += per * repeats
        ids = jnp.arange(first, first + len(unit) * repeats).reshape(repeats, len(unit))

        def body(carry, step, unit=unit):
            at = {"dense_layers": 0, "layers": 0}
            outs = []
            for j, kind in enumerate(unit):
                stack = "layers" if kind else "dense_layers"
                p = jax.tree.map(lambda a, k=at[stack]: a[k], step[0][stack])
                at[stack] += 1
                carry, out = one_layer(carry, p, step[1][j])
                if kind and out is not None:
                    outs.append(out)
            return carry, (jax.tree.map(lambda *a: jnp.stack(a), *outs) if outs else None)

        carry, out = jax.lax.scan(body, carry, (xs, ids), unroll=min(unroll, repeats))
        if out is not None:  # [repeats, MoE layers per unit, ...] -> [their layers, ...] in order
            outputs.append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), out))
    if not outputs:
        return carry, None
    return carry, jax.tree.map(lambda *a: jnp.concatenate(a), *outputs)
