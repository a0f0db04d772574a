"""Dropless MoE at the routed FLOPs: each expert's assignments sorted together and multiplied as one
group (a grouped GEMM), instead of capacity buffers that run every expert over every token.

**Layout** (every kernel): the assignments in expert order, each expert's run padded to a whole
number of TILE-row tiles (MegaBlocks' block padding: at most E x (TILE - 1) rows more than routed),
a static buffer of `grouped_rows` rows, of which the first `used` tiles hold assignments and the
rest zeros. A token's assignment to expert e sits at row start_e + (its rank among e's
assignments, in token order).

**Kernels** (`model.moe_kernel`; `auto` takes the device's):
- `tiled` (CPU, meshlm's own): a loop over the tiles, each two GEMMs with its expert's weights
  sliced out (gate and up side by side, [d, 2f], one GEMM for both); tiles past the last used one
  are skipped (`lax.cond`). Its custom VJP runs the same loop backward, recomputing silu(gate) x up
  from the kept gate and up, and adding each tile's weight gradients (fp32) into its expert's. (Before
  2026-12-07 a step was 4 tiles with their weights gathered and batched GEMMs: forward + backward
  1.12-1.18x slower at moe-tiny's shapes in a one-device process (alternating rounds of a scratch
  A/B script, not committed), where the gather of the weights cost more than the GEMMs it saved; but
  1.14x faster in an 8-device process, where XLA:CPU runs the small GEMMs slower, cause not found.)
- `ragged_dot` (GPU, and TPU, where it ran 1.5x megablox): `jax.lax.ragged_dot` over the padded
  groups. Whether XLA:GPU lowers it to a grouped GEMM is unverified here (no GPU has run it);
  XLA:CPU lowers it to a dense dot over every group, so on CPU it is a reference only.
- `megablox` (TPU, when asked): JAX's Pallas `gmm` (MaxText's kernel), in interpret mode off TPU
  (tested so). Its rows past the groups are left unwritten: they are zeroed here.
Each kernel keeps the tiles' input, gate and up for the backward pass and recomputes the rest (the
ragged_dot and megablox paths by a checkpoint that saves those two by name).

**Expert parallelism** (`exchange`): each device packs its assignments by destination into a
worst-case buffer [X, n, d] (any device may receive all n of another's assignments: X x its routed
rows, where capacity buffers dropless send E/k x) and sends it with the local expert ids; each runs
its experts over the X n received rows (the tile loop skips the empty tiles) and sends the rows
back. How the rows travel (`moe_costs.EXCHANGE_OP`, by platform):
- `all_to_all` (CPU): the whole buffer, padding included: X x the routed rows.
- `ragged` (GPU, TPU): `jax.lax.ragged_all_to_all` sends each destination's used rows only (the
  routed rows) into the same places of the same buffers; the ids (int32) still go by all_to_all.
  XLA:CPU does not implement the op, so the suite runs this path with the op replaced by an emulation
  of its documented semantics (tests/test_moe.py); the op itself has run on one TPU v5e chip only
  (benchmarks/tpu.py: a self-exchange, and uneven slices), never across devices: untested there.

On a TPU v5e (benchmarks/tpu.sh), megablox and ragged_dot gave moe-tiny's raw gradients to 1.5e-6 of
the tiled kernel's on the host CPU; at Qwen3-30B-A3B's expert shapes ragged_dot ran 1.5x megablox's
tiling here, both at 20-30% of dense GEMMs' rate (BENCHMARKS.md, "First accelerator").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from meshlm.model.moe_costs import TILE


def rank_within(ids: jax.Array, n: int, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """(each entry's rank among the entries before it with the same id along `axis`, the count of
    each id [.., n]) for int ids in [0, n) (others: rank 0, uncounted), by a cumulative one-hot sum."""
    one_hot = (jnp.expand_dims(ids, -1) == jnp.arange(n, dtype=ids.dtype)).astype(jnp.int32)
    return jnp.sum((jnp.cumsum(one_hot, axis=axis) - 1) * one_hot, axis=-1), jnp.sum(one_hot, axis=axis)


class Groups:
    """Where each assignment sits in the grouped buffer, and which expert each tile runs.

    row [n] int32: its row (rows when it has no expert: out of range, reads and writes nothing);
    tile_expert [tiles] int32; used_rows: rows of the tiles in use; sizes [E] int32: the padded
    group sizes (sum = used_rows)."""

    def __init__(self, expert: jax.Array, n_experts: int, rows: int):
        rank, counts = rank_within(expert, n_experts)  # among e's assignments, in order
        tiles = (counts + TILE - 1) // TILE
        end = jnp.cumsum(tiles)
        start = (end - tiles) * TILE
        valid = expert < n_experts  # an id of n_experts: no assignment (an empty exchange slot)
        self.row = jnp.where(valid, start[jnp.minimum(expert, n_experts - 1)] + rank, rows).astype(jnp.int32)
        tile_index = jnp.arange(rows // TILE, dtype=end.dtype)
        self.tile_expert = jnp.minimum(jnp.sum(tile_index[:, None] >= end, axis=-1), n_experts - 1).astype(jnp.int32)
        self.used_rows = (end[-1] * TILE).astype(jnp.int32)
        self.sizes = (tiles * TILE).astype(jnp.int32)
        self.rows = rows

    def gather(self, x_nd: jax.Array, source: jax.Array) -> jax.Array:
        """The buffer [rows, d]: row `row[i]` holds x[source[i]]; zeros elsewhere."""
        filler = jnp.full((self.rows,), x_nd.shape[0], jnp.int32).at[self.row].set(source, mode="drop")
        return jnp.take(x_nd, filler, axis=0, mode="fill", fill_value=0)

    def scatter(self, out_rd: jax.Array) -> jax.Array:
        """Each assignment's output [n, d] (zeros for one without an expert)."""
        return jnp.take(out_rd, self.row, axis=0, mode="fill", fill_value=0)


def expert_swiglu(
    x_rd: jax.Array, g: Groups, w_gate, w_up, w_down, act: Callable, kernel: str, interpret: bool = False
) -> jax.Array:
    """Every assignment's expert SwiGLU over the grouped buffer x [rows, d]: [rows, d]."""
    if kernel == "tiled":
        return _tiled(x_rd, g.tile_expert, g.used_rows, w_gate, w_up, w_down, act)
    if kernel == "ragged_dot":
        mul = functools.partial(jax.lax.ragged_dot, group_sizes=g.sizes)
    else:
        from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

        def mul(lhs, rhs):
            tiling = (TILE, _tile(lhs.shape[1]), _tile(rhs.shape[2]))
            # positional: ops.gmm is a custom_vjp whose static arguments are found by position
            # (lhs, rhs, group_sizes, preferred_element_type, tiling, group_offset, existing_out,
            # transpose_rhs, interpret)
            out = megablox.gmm(lhs, rhs, g.sizes, lhs.dtype, tiling, None, None, False, interpret)
            return jnp.where(jnp.arange(lhs.shape[0])[:, None] < g.used_rows, out, 0)  # unwritten rows

    def ffn(x):
        gate = checkpoint_name(mul(x, w_gate), "expert_gate")
        up = checkpoint_name(mul(x, w_up), "expert_up")
        return mul(act(gate, up), w_down)

    keep = jax.checkpoint_policies.save_only_these_names("expert_gate", "expert_up")
    return jax.checkpoint(ffn, policy=keep)(x_rd)


def _tile(n: int) -> int:
    """megablox's tile along a contracted or output dimension: the largest of 512/256/128 dividing it."""
    return next((c for c in (512, 256, 128) if n % c == 0), n)


def _w(w: jax.Array, e: jax.Array) -> jax.Array:
    """Expert e's weight: a dynamic slice (one expert's, contiguous), not a gather."""
    return jax.lax.dynamic_index_in_dim(w, e, keepdims=False)


def _gate_up(w_gate, w_up, e) -> jax.Array:
    """Expert e's gate and up weights side by side [d, 2f]: one GEMM for both."""
    return jnp.concatenate([_w(w_gate, e), _w(w_up, e)], axis=-1)


def _batched(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b as a dot with a batch dimension (of 1): the `dots` remat policy, which keeps dots without
    batch dimensions, recomputes it, as the accounting counts the experts under it."""
    return jax.lax.dot_general(a[None], b[None], (((2,), (1,)), ((0,), (0,))))[0]


def _tiles(a: jax.Array) -> jax.Array:
    """[tiles x TILE, ...] -> [tiles, TILE, ...]."""
    return a.reshape(-1, TILE, *a.shape[1:])


def _firsts(x: jax.Array) -> jax.Array:
    """Each tile's first row."""
    return jnp.arange(x.shape[0] // TILE, dtype=jnp.int32) * TILE


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _tiled(x, tile_expert, used_rows, w_gate, w_up, w_down, act):
    return _tiled_fwd(x, tile_expert, used_rows, w_gate, w_up, w_down, act)[0]


def _tiled_fwd(x, tile_expert, used_rows, w_gate, w_up, w_down, act):
    """Keeps x, gate and up (one [rows, 2f] array) and the weights as they came (no copy)."""
    dtype = jnp.result_type(x, w_gate)

    def step(_, inputs):
        xs, e, first = inputs

        def run(xs):
            gate_up = _batched(xs, _gate_up(w_gate, w_up, e))
            return gate_up, _batched(act(*jnp.split(gate_up, 2, axis=-1)), _w(w_down, e))

        def skip(xs):
            return jnp.zeros((TILE, 2 * w_gate.shape[-1]), dtype), jnp.zeros((TILE, w_down.shape[-1]), dtype)

        return None, jax.lax.cond(first < used_rows, run, skip, xs)

    _, (gate_up, out) = jax.lax.scan(step, None, (_tiles(x), tile_expert, _firsts(x)))
    rows = x.shape[0]
    return out.reshape(rows, -1), (x, tile_expert, used_rows, gate_up.reshape(rows, -1), w_gate, w_up, w_down)


def _tiled_bwd(act, residuals, dy):
    x, tile_expert, used_rows, gate_up, w_gate, w_up, w_down = residuals
    f32 = jnp.float32
    E, d, f = w_gate.shape

    def step(grads, inputs):
        xs, gus, dys, e, first = inputs

        def run(_):  # the tile's weight gradients apart: the accumulators do not pass through the cond
            h, vjp = jax.vjp(act, *jnp.split(gus, 2, axis=-1))
            dgu = jnp.concatenate(vjp(dys @ _w(w_down, e).T), axis=-1)
            dw_gate_up = jnp.dot(xs.T, dgu, preferred_element_type=f32)
            dw_down = jnp.dot(h.T, dys, preferred_element_type=f32)
            return dw_gate_up, dw_down, (dgu @ _gate_up(w_gate, w_up, e).T).astype(xs.dtype)

        def skip(_):
            return jnp.zeros((d, 2 * f), f32), jnp.zeros(w_down.shape[1:], f32), jnp.zeros_like(xs)

        dw_gate_up, dw_down, dx = jax.lax.cond(first < used_rows, run, skip, None)
        return (grads[0].at[e].add(dw_gate_up), grads[1].at[e].add(dw_down)), dx

    zeros = (jnp.zeros((E, d, 2 * f), f32), jnp.zeros(w_down.shape, f32))
    inputs = (*(_tiles(a) for a in (x, gate_up, dy)), tile_expert, _firsts(x))
    (dw_gate_up, dw_down), dx = jax.lax.scan(step, zeros, inputs)
    dw_gate, dw_up = jnp.split(dw_gate_up, 2, axis=-1)
    dw = [g.astype(w.dtype) for g, w in zip((dw_gate, dw_up, dw_down), (w_gate, w_up, w_down), strict=True)]
    return (dx.reshape(x.shape), None, None, *dw)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def exchange(
    x_nd: jax.Array,
    expert: jax.Array,
    source: jax.Array,
    ep: str,
    ways: int,
    local_experts: int,
    run: Callable,
    ragged: bool = False,
) -> jax.Array:
    """Expert parallelism over mesh axis `ep` (`ways` devices, `local_experts` each): every
    assignment (global expert id `expert` [n], token row `source` [n] of x) goes to the device of its
    expert in a worst-case buffer [ways, n, d], the local experts run there (`run(rows [R, d], local
    expert ids [R])`), and the outputs come back: each assignment's output [n, d]. `ragged`: the rows
    travel by `ragged_all_to_all`, each destination's used rows only (sender i's at i n, as all_to_all
    leaves them; the rest of each buffer stays zero)."""
    n = expert.shape[0]
    dest = expert // local_experts
    rank, sizes = rank_within(dest, ways)
    slot = dest * n + rank  # packed by destination
    filler = jnp.full((ways * n,), x_nd.shape[0], jnp.int32).at[slot].set(source)
    send = jnp.take(x_nd, filler, axis=0, mode="fill", fill_value=0)
    ids = jnp.full((ways * n,), local_experts, jnp.int32).at[slot].set(expert % local_experts).reshape(ways, n)
    recv_ids = jax.lax.all_to_all(ids, ep, split_axis=0, concat_axis=0, tiled=True)
    move = _ragged_move(ep, ways, n, sizes.astype(jnp.int32)) if ragged else _whole_move(ep, ways, n)
    out = run(move(send), recv_ids.reshape(ways * n))
    return jnp.take(move(out, back=True), slot, axis=0)


def _whole_move(ep: str, ways: int, n: int) -> Callable:
    """The exchange's two moves by all_to_all: the whole [ways, n] buffer, padding included."""

    def move(rows, back=False):  # the same both ways
        return jax.lax.all_to_all(rows.reshape(ways, n, -1), ep, 0, 0, tiled=True).reshape(ways * n, -1)

    return move


def _ragged_move(ep: str, ways: int, n: int, sizes: jax.Array) -> Callable:
    """The exchange's two moves by `ragged_all_to_all`: out, this device's `sizes[j]` rows for device
    j (at j n of its buffer) to i n of j's buffer (i: this device); back, the `received[j]` rows
    from j at j n to i n of j's buffer. Rows not sent stay zero."""
    me = jax.lax.axis_index(ep).astype(jnp.int32)
    starts = jnp.arange(ways, dtype=jnp.int32) * n
    there = jnp.full((ways,), me * n, jnp.int32)  # where this device's rows land on every receiver
    received = jax.lax.all_to_all(sizes, ep, 0, 0, tiled=True)  # rows from each device

    def move(rows, back=False):
        out, back_sizes = (received, sizes) if back else (sizes, received)
        zeros = jnp.zeros_like(rows)
        return jax.lax.ragged_all_to_all(rows, zeros, starts, out, there, back_sizes, axis_name=ep)

    return move
