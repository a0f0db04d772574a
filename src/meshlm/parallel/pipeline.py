"""Pipeline parallelism: 1F1B, interleaved 1F1B, zero bubble (zb1, ZB-V) and GPipe in the jitted step.

The schedule is data (`parallel.schedules`): a static table of (tick, stage) -> a cell holding at
most one backward and one forward (paired ticks) or one action (single ticks). `slots.tables`
turns it into integer arrays - what each stage does at each tick, which buffer slot it reads and
writes - and `pipeline_gradients` runs them: one `lax.scan` over ticks inside a `shard_map` manual over
`stage` and the batch axes. Tensor, context and sequence parallelism stay what they are inside each
stage (GSPMD plus the tensor-parallel and context regions, nested: manual over the axes left automatic).

Each tick (`_Stage.tick`) every device runs its cell's backward phase, sends the cotangent to the
previous stage, runs its forward phase, sends the activation to the next stage. With single ticks
(`parallel.pipeline_ticks=single`: one action per cell, Megatron's in-flight counts) both sends
come at the tick's end, after whichever action the stage ran (ZB-V: both permutes carry the
stage's one message, and chunk p - 1 hands its output to chunk p on the same stage):

- backward B(i, c): the stashed residuals and the arrived cotangent give the chunk's weight
  gradients and its input cotangent (on the first chunk: back through the embedding);
- forward F(i, c): its input is the embedded microbatch (first chunk) or the arrived activation;
  `jax.vjp` of the chunk's layers gives the output and the residuals the remat policy keeps,
  stashed in a slot until B(i, c) - exactly what one device's autodiff would keep for those
  layers. On the last chunk the output layer and loss run at once, forward and backward, and the
  output's cotangent waits for B(i, c).
- zb1 and ZB-V split the backward (`parallel.taps`): B(i, c) gives the input cotangent and the
  output gradients of the tensor-parallel regions (their weights held constant), W(i, c) those
  weights' gradients from the regions' inputs and output gradients, kept in weight slots.

Each phase is a `lax.cond` (`_Stage.phase`; with the ring inside, masked), gradients added inside
the branch that makes them; the two `ppermute`s are entered by every device on every tick, outside
any branch (what an idle stage sends lands in a spare slot). Buffers are slot arrays sized by the table
(`parallel.slots`). Gradients are summed over the batch axes once, after the loop. The layers [L, ...]
are regrouped to [p, v, c, ...] (`stage_layout`: c = L/(pv); uneven: ceil, with identity pad slots
whose RouterStats and their cotangent `routed` zeroes); the embeddings and output layer are stored
split over fsdp x stage. An MoE model's dense first layers (`model.first_k_dense`) run on the first
chunk with the embedding, recomputed in its backward (`_Stage.embed`); a slot holds one layer of the
others, or a unit (dense, MoE: `sl.staged_params`). Residuals known while tracing (RoPE's tables) are
not stashed (`buffers.residual_source`). Dropout draws at each element's global position, microbatch i from
fold_in(key, i), as `step.gradients` does (docs/pipeline.md).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshlm import axes as ax
from meshlm.config import RunConfig
from meshlm.model import moe, mtp
from meshlm.model.params import param_specs, partition, trainable_mask
from meshlm.model.transformer import RESIDUAL, embed, output_loss, run_layers
from meshlm.model.weight_pass import region_shapes, weight_gradients
from meshlm.parallel import stage_layout as sl
from meshlm.parallel.buffers import CONSTANT, constants, residual_source, same_constants
from meshlm.parallel.buffers import put as _put
from meshlm.parallel.buffers import slots as _slots
from meshlm.parallel.buffers import take as _take
from meshlm.parallel.rules import Layout, constrain
from meshlm.parallel.schedules import pad_count, pipeline_unit, runs_unbranched, schedule_for, staged_units
from meshlm.parallel.slots import tables
from meshlm.parallel.stage_layout import AXIS


class Carry(NamedTuple):
    """What the tick loop carries from one tick to the next (`_Stage.carry`, `_Stage.tick`). The slot
    buffers are sized and addressed by the schedule's tables (`slots.tables`: a slot's lifetime in
    quarter ticks, `slots.QUARTERS`); the last slot of each inbox and of the weight slots is a
    spare that idle phases write."""

    act: jax.Array  # [act_slots, b, s, d]: activations arrived, not yet forwarded
    grad: jax.Array  # [grad_slots, b, s, d]: cotangents arrived (or made by the loss), not yet backwarded
    stash: list  # per residual leaf the forward keeps: [stash_slots, ...], one slot per microbatch-chunk in flight
    w_in: list  # zb1, ZB-V: per region input: [weight_slots, c, ...], the forwards' inputs for W
    w_grad: list  # zb1, ZB-V: per region output: [weight_slots, c, ...], B's output gradients for W
    w_in_next: tuple | None  # zb1, ZB-V: (slot, region inputs) of the last forward, written next tick
    g_layers: dict  # the stage's chunk weight gradients [v, c, ...], accumulated in the phases
    g_top: list  # the trained leaves' gradients of the other weights (`params.partition`; embeddings, prefix, MTP)
    loss: jax.Array  # summed token loss of the microbatches whose last chunk ran here
    count: jax.Array  # their counted tokens
    mtp: jax.Array  # [D] the MTP modules' loss sums (`model.mtp_depth`; [0] without)
    moe: dict | None  # MoE: the counts riding with the messages and every microbatch-chunk's RouterStats


class _Stage:
    """One stage's tick inside the pipeline region: the constants of the trace (schedule tables,
    shapes, the chunk weights of this stage, the residuals' structure) and the phases as methods.
    Built inside the `shard_map` body, so `stage` is this device's stage index."""

    def __init__(self, cfg: RunConfig, layout: Layout, tab, local, top, micro, key, idle_fill: float, tokens, ids):
        self.cfg, self.layout, self.tab, self.idle_fill = cfg, layout, tab, idle_fill
        self.local, self.top, self.micro, self.key = local, top, micro, key
        self.moe, self.tokens = cfg.model.moe, tokens  # MoE: each microbatch's counted tokens [m]
        self.p, self.m = cfg.parallel.stage, cfg.train.microbatches
        unit = pipeline_unit(cfg.model)  # dense first layers, run with the embedding; the chunks' units of layers
        self.prefix, self.depth = unit.prefix, cfg.model.mtp_depth  # MTP modules: with the loss on the last chunk
        uneven = pad_count(unit.count, self.p * cfg.parallel.virtual_stages)
        self.per_chunk, self.routed = ids.shape[1], sl.routed if uneven else lambda st, _: st
        self.layer_ids = ids  # [v, c(, u)] the layer ids of this stage's chunks, -1 a pad (`sl.layer_ids`)
        self.dtype = jnp.dtype(cfg.model.dtype)
        self.policy_chunks = cfg.remat.policy, cfg.remat.loss_chunks  # the output layer and loss (`output_loss`)
        b, s_len = micro["inputs"].shape[1:3]
        self.x_shape = (b, s_len, cfg.model.d_model)
        self.stage = jax.lax.axis_index(AXIS)
        specs = sl.staged_params(param_specs(cfg.model), cfg.model)
        # LoRA: only the adapters are differentiated and accumulated (a dense prefix's among the top
        # weights); the frozen weights, the embeddings and the output layer get no gradient
        mask = trainable_mask(sl.top_specs(specs))
        self.top_shardings = partition(sl.top_shardings(layout, specs, inside=True), mask)[0]
        self.trained = {n for n, spec in specs["layers"].items() if spec.trainable}
        self.top_train, self.top_frozen, self.join_top = partition(top, mask)
        self.split = tab.weight_slots > 0  # zb1: B and W apart
        self.unbranched = runs_unbranched(cfg.parallel)  # the ring inside the stages (see `phase`)
        self.w_inputs, self.w_grads = [], []  # zb1: a weight slot's region inputs and output gradients
        if self.split:
            x = jax.ShapeDtypeStruct(self.x_shape, self.dtype)
            layer = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape[2:], self.dtype), local)
            ins, outs, self.region_names = region_shapes(x, layer, cfg.model, layout)
            stacked = lambda a: jax.ShapeDtypeStruct((self.per_chunk, *a.shape), a.dtype)
            self.w_inputs, self.w_grads = [stacked(a) for a in ins], [stacked(a) for a in outs]
        self._probe_residuals()
        self.mtp_stats_shape = None  # MoE MTP: the modules' RouterStats [D, b, ...]
        if self.moe and self.depth:
            mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), micro)
            y = jax.ShapeDtypeStruct(self.x_shape, self.dtype)
            objective = partial(mtp.objective, cfg=cfg.model, layout=layout, key=None, remat_policy="elementwise")
            self.mtp_stats_shape = jax.eval_shape(lambda y, mb: objective(top, y, mb)[1], y, mb)

    # ------------------------------------------------------------------ pieces

    def top_layout(self, tree: dict) -> dict:
        return jax.tree.map(jax.lax.with_sharding_constraint, tree, self.top_shardings) if tree else tree

    def resid(self, x: jax.Array) -> jax.Array:
        return constrain(self.layout, x, RESIDUAL)

    def filled(self) -> jax.Array:
        return self.resid(jnp.full(self.x_shape, self.idle_fill, self.dtype))

    @staticmethod
    def accumulate(g_layers: dict, lc, dw: dict, live: jax.Array | None = None) -> dict:
        """The chunk's gradient accumulators with `dw` (some or all of its weights) added, in place;
        masked by `live` in an unbranched phase (`phase`)."""
        if live is not None:
            dw = jax.tree.map(lambda d: jnp.where(live, d, jnp.zeros_like(d)), dw)
        return {n: _put(a, lc, _take(a, lc) + dw[n].astype(jnp.float32)) if n in dw else a for n, a in g_layers.items()}

    def spare(self, like: list) -> list:
        """What an idle phase writes into zb1's spare weight slot (nothing reads it)."""
        return [_slots((), a, self.idle_fill) for a in like]

    def chunk_weights(self, lc):  # cast before the vjp, so residual weights are these very arrays
        return jax.tree.map(lambda w: _take(w, lc).astype(self.dtype), self.local)

    def mb_key(self, i):
        if self.key is None:
            return None
        return self.key if self.m == 1 else jax.random.fold_in(self.key, i)

    def context(self, micro_i, chunk):
        """The microbatch, its dropout key and the global layer ids of this stage's local chunk (-1: a pad slot)."""
        ids = _take(self.layer_ids, chunk)
        return jax.tree.map(lambda a: _take(a, micro_i), self.micro), self.mb_key(micro_i), ids

    def embed(self, top, mb, k):
        """The first chunk's input: the embedded microbatch, through the dense first layers of an MoE
        model (`model.first_k_dense`, layers 0 .. k-1). B(i, 0) runs this again under its vjp, so
        those layers are recomputed (as under `remat.policy=full`) and stash nothing."""
        x = embed(top, mb["inputs"], self.cfg.model, self.layout, k, mb.get("positions")).astype(self.dtype)
        if not self.prefix:
            return x
        ids, policy = jnp.arange(self.prefix), self.cfg.remat.policy
        seg = mb.get("segment_ids")
        x, _ = run_layers(x, top[sl.PREFIX], ids, self.cfg.model, self.layout, k, policy, seg)
        return x.astype(self.dtype)

    def loss(self, y, top, mb):
        return output_loss(top, y, mb["targets"], mb.get("mask"), self.cfg.model, self.layout, *self.policy_chunks)

    @staticmethod
    def counts(first: jax.Array, arrived: jax.Array, stats) -> jax.Array:
        """MoE: a forward's assignments per expert on this device's rows: those that arrived with its
        input (none on the first chunk) plus its chunk's."""
        return jnp.where(first.astype(bool), 0.0, arrived) + stats.counts.sum(axis=(0, 1))

    def batch_sum(self, x: jax.Array) -> jax.Array:
        batch_axes = manual_batch_axes(self.layout)
        return jax.lax.psum(x, batch_axes) if batch_axes else x

    def head(self, y, mb, k, micro_i, before):
        """The last chunk's output layer and loss, and the MTP modules (`model.mtp`; the objective adds
        `mtp.weighted` of their loss sums, as `step.objective_sum`), forward and backward: (dy, the
        gradients of the weights outside the layers - None when frozen, loss sum, token count, the
        modules' loss sums [D], their RouterStats or None). MoE: the modules' share of the router
        losses needs the microbatch's assignments over every MoE layer and row - `before` (this
        device's rows: the chunks' that arrived and this one's) plus the modules', summed over the
        batch axes here as `moe_tick` sums them after the forward."""
        m = self.cfg.model

        def objective(y, top):
            ls, cnt = self.loss(y, top, mb)
            if not self.depth:
                return (ls, None), (ls, cnt, jnp.zeros((0,), jnp.float32))
            sums, stats = mtp.objective(top, y, mb, m, self.layout, k, *self.policy_chunks)
            return (ls + mtp.weighted(sums, m), stats), (ls, cnt, sums)

        with_top = lambda y, t: objective(y, self.join_top(t, self.top_frozen))
        f, args = (with_top, (y, self.top_train)) if self.top_train else (lambda y: objective(y, self.top), (y,))
        (obj, stats), vjp_fn, (ls, cnt, sums) = jax.vjp(f, *args, has_aux=True)
        cot = None
        if stats is not None:
            total = self.batch_sum(before + stats.counts.sum(axis=(0, 1)))
            cot = self.stats_cotangent(micro_i, (stats, total))
        grads = vjp_fn((jnp.ones_like(obj), cot))
        return grads[0], grads[1] if self.top_train else None, ls, cnt, sums, stats

    def vjp_parts(self, w, x, k, ids, seg):
        """The chunk's output and its MoE layers' RouterStats (None without), their vjp (a function
        of both cotangents), which residuals are the chunk's weights themselves (index into w's
        leaves, else None: those are not stashed but taken again in B), and (zb1) the regions'
        inputs its weight pass needs; the vjp then also gives the regions' output gradients."""
        run = partial(run_layers, layer_ids=ids, cfg=self.cfg.model, layout=self.layout, key=k, segment_ids=seg)
        run = partial(run, remat_policy=self.cfg.remat.policy)
        # held constant: frozen weights, and (zb1) the regions' weights, whose gradients come from W
        held = {n: a for n, a in w.items() if n not in self.trained or (self.split and n in self.region_names)}
        other = {n: a for n, a in w.items() if n not in held}
        if self.split:
            taps = [jnp.zeros(a.shape, a.dtype) for a in self.w_grads]

            def f(wo, x, t):
                y, (stats, inputs) = run(x, {**wo, **held}, taps=t)
                return (y, stats), inputs

            (y, stats), vjp_fn, inputs = jax.vjp(f, other, x, taps, has_aux=True)
        else:
            ((y, stats), vjp_fn), inputs = jax.vjp(lambda wo, x: run(x, {**wo, **held}), other, x), []
        w_leaves = jax.tree.leaves(w)
        return y, stats, vjp_fn, tuple(residual_source(r, w_leaves) for r in jax.tree.leaves(vjp_fn)), inputs

    def _probe_residuals(self) -> None:
        """Trace one chunk's vjp abstractly: the residuals' structure, which are weights, where each lives."""
        probe = {}

        def residuals(w, x):
            mb, k, ids = self.context(0, 0)
            _, stats, vjp_fn, probe["where"], _ = self.vjp_parts(w, x, k, ids, mb.get("segment_ids"))
            leaves = jax.tree.leaves(vjp_fn)
            probe["host"] = [jax.typeof(r).memory_space == jax.memory.Space.Host for r in leaves]
            probe["consts"] = constants(leaves, probe["where"])  # taken again in B, not stashed
            return vjp_fn, stats

        w0 = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], self.dtype), self.local)
        x0 = jax.ShapeDtypeStruct(self.x_shape, self.dtype)
        vjp_shape, self.stats_shape = jax.eval_shape(residuals, w0, x0)
        leaves, self.treedef = jax.tree.flatten(vjp_shape)
        self.where, self.consts = probe["where"], probe["consts"]
        self.stashed = [(a, host) for a, j, host in zip(leaves, self.where, probe["host"], strict=True) if j is None]

    def stash_of(self, vjp_fn, w_where) -> list:
        leaves = jax.tree.leaves(vjp_fn)
        if w_where != self.where or not same_constants(self.consts, leaves):
            raise AssertionError("the chunk's residuals changed structure or constants between traces")
        return [leaf for leaf, j in zip(leaves, self.where, strict=True) if j is None]

    def rebuilt_vjp(self, res, lc):
        w_leaves, it = jax.tree.leaves(self.chunk_weights(lc)), iter(res)
        leaf = lambda j, c: next(it) if j is None else c if j == CONSTANT else w_leaves[j]
        return jax.tree.unflatten(self.treedef, [leaf(j, c) for j, c in zip(self.where, self.consts, strict=True)])

    # ------------------------------------------------------------------ the phases

    def phase(self, on: jax.Array, run, idle):
        """`run(None)` where the cell has this phase, else `idle()`: a `lax.cond`, so an idle stage
        computes nothing. With the ring inside the stages, whose permutes every device must enter in
        the same order (docs/pipeline.md), `run(live)` on every stage at every tick
        (`Schedule.lockstep_time(unbranched=True)`), selecting nothing whole: increments masked by
        `live` (`accumulate`), the loss and the embeddings' vjp in branches on it, messages and
        weight-slot values into the spare slots the tables give an idle cell, the stash slot
        selected. Weight passes hold no ring op (their attention is dead code) and stay branched."""
        on = on.astype(bool)
        if not self.unbranched:
            return jax.lax.cond(on, lambda: run(None), idle)
        return run(on)

    def stats_cotangent(self, micro_i, moe_in):
        """MoE: the cotangent of a chunk's RouterStats, the gradient of its share of the router
        losses (`moe.router_objective_share`) given `moe_in` = (the stats, the microbatch's
        assignments per expert over all its layers and rows); None without MoE."""
        if moe_in is None:
            return None
        stats, total = moe_in
        rows = self.cfg.train.global_batch // self.m
        share = lambda st: moe.router_objective_share(st, total, _take(self.tokens, micro_i), self.cfg.model, rows)
        return jax.grad(share)(stats)

    def backward(self, r, res, dy, g_layers, g_top, moe_in=None):
        """B(i, c), or nothing when the cell has no backward: (the accumulated chunk weight
        gradients and embedding gradients with this backward's added, the cotangent to send to the
        previous stage, zb1's region output gradients for W - for the spare weight slot when idle).
        Accumulated inside the branch (unbranched: masked increments). MoE: `moe_in` gives
        the cotangent of the chunk's router statistics (`stats_cotangent`)."""

        def run(live):
            mb, k, ids = self.context(r["b_micro"], r["b_chunk"])
            cot = (self.resid(dy), self.routed(self.stats_cotangent(r["b_micro"], moe_in), ids))
            dw, dx, *taps = self.rebuilt_vjp(res, r["b_chunk"])(cot)
            lc = r["b_chunk"]
            acc = self.accumulate(g_layers, lc, dw, live)
            out_taps = [g.astype(a.dtype) for g, a in zip(taps[0], self.w_grads, strict=True)] if taps else []

            def through_embedding():
                _, vjp_embed = jax.vjp(lambda t: self.embed(self.join_top(t, self.top_frozen), mb, k), self.top_train)
                return self.top_layout(jax.tree.map(jnp.add, g_top, vjp_embed(dx)[0]))

            first = r["b_first"].astype(bool)
            into_top = first if live is None else first & live
            keep_top = lambda: self.top_layout(g_top)
            top = jax.lax.cond(into_top, through_embedding, keep_top) if self.top_train else g_top
            return acc, top, jnp.where(first, self.filled(), self.resid(dx.astype(self.dtype))), out_taps

        idle = lambda: (g_layers, self.top_layout(g_top), self.filled(), self.spare(self.w_grads))
        return self.phase(r["b"], run, idle)

    def weight_pass(self, r, which: str, w_in: list, w_grad: list, g_layers):
        """W (zb1) of segment `which` (w1 before the cotangent's send, w2 after it), or nothing: the
        chunk's region weight gradients, from the region inputs and output gradients its forward
        and B left in a weight slot (read inside the branch, so an idle pass reads nothing), added
        to their accumulators."""
        if not self.split:
            return g_layers
        lc, slot = r[f"{which}_chunk"], r[f"{which}_slot"]

        def run():  # branched (no ring op)
            inputs, grads = [_take(b, slot) for b in w_in], [_take(b, slot) for b in w_grad]
            dw = weight_gradients(self.chunk_weights(lc), inputs, grads, self.region_names, self.cfg.model, self.layout)
            return self.accumulate(g_layers, lc, dw)

        return jax.lax.cond(r[which].astype(bool), run, lambda: g_layers)  # no ring op in W

    def forward(self, r, x_in, res_keep, g_top, arrived=None):
        """F(i, c), or nothing: (residuals to stash, activation to send, the loss's cotangent to
        file, the accumulated head gradients with this forward's added, loss, token count, zb1's
        region inputs for W - for the spare weight slot when idle, the chunk's RouterStats (idle:
        for the spare row m), None without MoE; the MTP modules' loss sums [D] and RouterStats, None
        without MoE MTP). `res_keep` is what an idle forward writes back into the stash slot; `arrived`
        (MoE) the counts that came with the input."""
        zero, no_sums = jnp.zeros((), jnp.float32), jnp.zeros((self.depth,), jnp.float32)
        no_mtp_stats = lambda: jax.tree.map(lambda a: _slots((), a, self.idle_fill), self.mtp_stats_shape)

        def run(live):
            mb, k, ids = self.context(r["f_micro"], r["f_chunk"])
            first, last = r["f_first"].astype(bool), r["f_last"].astype(bool)
            # both branches of every cond state their outputs' layout (XLA requires them equal)
            x = jax.lax.cond(first, lambda: self.resid(self.embed(self.top, mb, k)), lambda: self.resid(x_in))
            w = self.chunk_weights(r["f_chunk"])
            y, stats, vjp_fn, w_where, inputs = self.vjp_parts(w, x, k, ids, mb.get("segment_ids"))
            stats = self.routed(stats, ids)
            inputs = [a.astype(b.dtype) for a, b in zip(inputs, self.w_inputs, strict=True)] if self.split else []

            def with_loss():
                before = None if stats is None else self.counts(first, arrived, stats)
                dy, dtop, ls, cnt, sums, mtp_stats = self.head(y, mb, k, r["f_micro"], before)
                top = g_top if dtop is None else self.top_layout(jax.tree.map(jnp.add, g_top, dtop))  # LoRA: frozen
                return self.resid(dy.astype(self.dtype)), top, ls, cnt, sums, mtp_stats

            no_mtp = no_mtp_stats() if self.mtp_stats_shape else None
            no_loss = lambda: (self.filled(), self.top_layout(g_top), zero, zero, no_sums, no_mtp)
            dy, top, ls, cnt, sums, mtp_stats = jax.lax.cond(last if live is None else last & live, with_loss, no_loss)
            send = jnp.where(last, self.filled(), self.resid(y.astype(self.dtype)))
            stash = self.stash_of(vjp_fn, w_where)
            if live is not None:  # unbranched: an idle cell's stash slot holds a live microbatch-chunk
                stash = [jnp.where(live, a, b) for a, b in zip(stash, res_keep, strict=True)]
            return stash, send, dy, top, ls, cnt, inputs, stats, sums, mtp_stats

        def idle():
            stats = jax.tree.map(lambda a: _slots((), a, self.idle_fill), self.stats_shape)
            filled, mtp_stats = self.filled(), no_mtp_stats() if self.mtp_stats_shape else None
            spare = self.spare(self.w_inputs)
            return res_keep, filled, filled, self.top_layout(g_top), zero, zero, spare, stats, no_sums, mtp_stats

        return self.phase(r["f"], run, idle)

    def carry(self) -> Carry:
        x = jax.ShapeDtypeStruct(self.x_shape, self.dtype)
        inbox = lambda n: constrain(self.layout, _slots((n,), x, self.idle_fill), (None, *RESIDUAL))
        weight_slots = lambda like: [_slots((self.tab.weight_slots,), a, self.idle_fill) for a in like]
        return Carry(
            act=inbox(self.tab.act_slots),
            grad=inbox(self.tab.grad_slots),
            stash=[_slots((self.tab.stash_slots,), leaf, self.idle_fill, host) for leaf, host in self.stashed],
            w_in=weight_slots(self.w_inputs) if self.split else [],
            w_grad=weight_slots(self.w_grads) if self.split else [],
            w_in_next=(jnp.int32(self.tab.weight_slots - 1), self.spare(self.w_inputs)) if self.split else None,
            g_layers={n: jnp.zeros_like(w) for n, w in self.local.items() if n in self.trained},
            g_top=[jnp.zeros_like(w) for w in self.top_train],
            loss=jnp.zeros((), jnp.float32),
            count=jnp.zeros((), jnp.float32),
            mtp=jnp.zeros((self.depth,), jnp.float32),
            # MoE: each (microbatch, chunk)'s RouterStats (row m: what idle forwards write)
            moe=self.moe_carry() if self.moe else None,
        )

    def moe_carry(self) -> dict:
        counts = jax.ShapeDtypeStruct((self.cfg.model.n_experts,), jnp.float32)
        v = self.cfg.parallel.virtual_stages
        out = {
            "act": _slots((self.tab.act_slots,), counts, self.idle_fill),
            "grad": _slots((self.tab.grad_slots,), counts, self.idle_fill),
            "stats": jax.tree.map(lambda a: _slots((self.m + 1, v), a, self.idle_fill), self.stats_shape),
        }
        if self.mtp_stats_shape:  # each microbatch's MTP modules' RouterStats (row m: idle)
            out["mtp_stats"] = jax.tree.map(lambda a: _slots((self.m + 1,), a, self.idle_fill), self.mtp_stats_shape)
        return out

    def moe_tick(self, c: dict, r: dict, stats, send_act, got_moe_grad, mtp_stats=None) -> tuple:
        """MoE's part of a tick after the forward: the forward's counts (those that arrived with its
        input plus its chunk's, on this device's rows; on the last chunk the MTP modules' too) go
        right with its activation; summed over the batch axes they are the microbatch's total on the
        last chunk, filed with the loss's cotangent; its stats are kept for its backward and the
        metrics. (the activation received, the new MoE carry)."""
        arrived = _take(c["act"], r["act_read"])
        counts = self.counts(r["f_first"], arrived, stats)
        with_mtp = r["f"].astype(bool) & r["f_last"].astype(bool)
        if mtp_stats is not None:
            counts = counts + jnp.where(with_mtp, mtp_stats.counts.sum(axis=(0, 1)), 0.0)
        total = self.batch_sum(counts)
        got_act, got_counts = jax.lax.ppermute((send_act, counts), AXIS, [(j, (j + 1) % self.p) for j in range(self.p)])
        i = jnp.where(r["f"].astype(bool), r["f_micro"], self.m)
        put = lambda buf, a: jax.lax.dynamic_update_slice(
            buf, a[None, None].astype(buf.dtype), (i, r["f_chunk"], *(0,) * a.ndim)
        )
        grad = _put(_put(c["grad"], r["grad_write"], total), r["recv_grad"], got_moe_grad)
        out = {
            "act": _put(c["act"], r["recv_act"], got_counts),
            "grad": grad,
            "stats": jax.tree.map(put, c["stats"], stats),
        }
        if mtp_stats is not None:
            row = jnp.where(with_mtp, r["f_micro"], self.m)
            out["mtp_stats"] = jax.tree.map(lambda buf, a: _put(buf, row, a), c["mtp_stats"], mtp_stats)
        return got_act, out

    def tick(self, c: Carry, row: dict) -> tuple[Carry, None]:
        """One tick: the cell's backward, (zb1) its first weight pass, its cotangent sent left,
        (zb1) the second weight pass, the cell's forward, its activation sent right (single ticks:
        both sends after the forward phase, so no stage waits on a neighbour mid-tick; ZB-V: both
        permutes carry the stage's one message, `slots.route`). Slot buffers
        are read before a phase and written after it, so XLA updates them in place instead of
        copying them through a conditional; the gradient accumulators pass through the phases
        (aliased: the compiled loop copies none of them; unbranched, they take masked increments).
        Sends are entered by every device on every tick, outside any branch (what an idle stage
        sends, a filler or an unbranched phase's garbage, lands in a spare slot)."""
        r = {k: _take(a, self.stage) for k, a in row.items()}
        moe_c, moe_b = c.moe, None
        if self.moe:  # the backward's chunk stats and the microbatch's total counts
            at = lambda a: _take(_take(a, r["b_micro"]), r["b_chunk"])
            moe_b = (jax.tree.map(at, moe_c["stats"]), _take(moe_c["grad"], r["grad_read"]))
        # the previous tick's forward's region inputs are written first: every write to the weight
        # slots then precedes the weight passes' reads (inside their branches), and XLA need not
        # copy the whole buffer to keep the old value for a read that a later write would clobber
        slot, inputs = c.w_in_next or (None, [])
        w_in = [_put(buf, slot, a) for buf, a in zip(c.w_in, inputs, strict=True)]
        res_b = [_take(buf, r["b_stash"]) for buf in c.stash]
        g_layers, g_top, send_grad, taps = self.backward(
            r, res_b, _take(c.grad, r["grad_read"]), c.g_layers, c.g_top, moe_b
        )
        w_grad = [_put(buf, r["b_wslot"], g) for buf, g in zip(c.w_grad, taps, strict=True)]
        g_layers = self.weight_pass(r, "w1", w_in, w_grad, g_layers)
        left = [(j, (j - 1) % self.p) for j in range(self.p)]
        # the microbatch's total counts (MoE) go back with the cotangent
        send_left = lambda msg: jax.lax.ppermute((msg, moe_b[1] if self.moe else None), AXIS, left)
        if not self.tab.single:  # paired ticks: the cotangent leaves before the forward runs
            got_grad, got_moe_grad = send_left(send_grad)
        g_layers = self.weight_pass(r, "w2", w_in, w_grad, g_layers)
        arrived = _take(moe_c["act"], r["act_read"]) if self.moe else None
        x_in = _take(c.act, r["act_read"])
        res, send_act, dy, g_top, ls, cnt, inputs, stats, sums, mtp_stats = self.forward(r, x_in, res_b, g_top, arrived)
        to_right = send_act
        if self.tab.single:  # one action per tick: every stage computes, then both sends
            # the barrier makes the cotangent's send wait for the forward (XLA may otherwise issue it
            # as soon as the backward is done, and a stage would wait on its neighbour mid-tick)
            send_grad, send_act = jax.lax.optimization_barrier((send_grad, send_act))
            to_left, to_right = send_grad, send_act
            if self.tab.v_shape:  # ZB-V: a message may go either way (`slots.route`): both permutes carry
                # the stage's one message of the tick, and the receivers' rows file the real arrival
                to_left = to_right = jnp.where(r["f"].astype(bool), send_act, send_grad)
            got_grad, got_moe_grad = send_left(to_left)
        if self.moe:
            got_act, moe_c = self.moe_tick(moe_c, r, stats, send_act, got_moe_grad, mtp_stats)
        else:
            got_act = jax.lax.ppermute(to_right, AXIS, [(j, (j + 1) % self.p) for j in range(self.p)])
        act = _put(c.act, r["recv_act"], got_act)
        grad = _put(_put(c.grad, r["grad_write"], dy), r["recv_grad"], got_grad)
        if self.tab.v_shape:  # what arrived from the other side, and the turn at the V's bottom
            act = _put(_put(act, r["recv_act_r"], got_grad), r["keep_act"], send_act)
            grad = _put(_put(grad, r["recv_grad_l"], got_act), r["keep_grad"], send_grad)
        return Carry(
            act=act,
            grad=grad,
            stash=[_put(buf, r["f_stash"], leaf) for buf, leaf in zip(c.stash, res, strict=True)],
            w_in=w_in,
            w_in_next=(r["f_wslot"], inputs) if self.split else None,
            w_grad=w_grad,
            g_layers=g_layers,
            g_top=g_top,
            loss=c.loss + ls,
            count=c.count + cnt,
            mtp=c.mtp + sums,
            moe=moe_c,
        ), None


def manual_batch_axes(layout: Layout) -> tuple[str, ...]:
    """The batch axes the stage region is manual over (those of size > 1). A function of its own so
    that a test can compile the region manual over `stage` alone and see the per-tick reduction."""
    return layout.mesh_axes(ax.BATCH)


def pipeline_gradients(
    params: dict,
    batch: dict,
    key: jax.Array | None,
    cfg: RunConfig,
    layout: Layout,
    split_microbatches,
    idle_fill: float = 0.0,
):
    """(summed gradients, summed token loss, token count, MoE metrics) of one global batch through
    the pipeline, as `step.gradients` computes them without one (before its division by the count).
    MoE: the router losses' gradients come from each chunk's share (`_Stage.stats_cotangent`), and
    the metrics from every layer's RouterStats of every microbatch, as `step.gradients` has them.

    `split_microbatches(batch, m)` gives [m, b/m, ...] arrays. `idle_fill` is what empty slots hold
    and what idle branches send (tests fill them with NaN to show that bubbles are inert)."""
    schedule = schedule_for(cfg)
    tab = tables(schedule)
    p, v, m = schedule.stages, schedule.virtual, schedule.microbatches
    slots = sl.layer_slots(staged_units(cfg.model), p * v)
    regroup = partial(sl.regroup_stored, schedule=schedule, slots=slots, layout=layout)
    params, specs = sl.staged_params(params, cfg.model), sl.staged_params(param_specs(cfg.model), cfg.model)  # "j:name"
    # Gathered once per step (not once per tick), their gradients summed after the loop and sliced
    # back to the shards by the caller's constraint: each stage's layers over fsdp, and the other
    # weights (embeddings, output layer, dense prefix, MTP), stored split over fsdp x stage (1/p of them
    # and their optimizer state per device), over both. The stage split of the layers and the tensor
    # splits remain.
    keep = lambda w, axes: jax.lax.with_sharding_constraint(w, sl.kept(layout, axes))
    stacked_axes = {n: (ax.LAYERS, None, None, *specs["layers"][n].axes[1:]) for n in params["layers"]}
    stacked = {n: keep(regroup(w, n, specs["layers"][n]), stacked_axes[n]) for n, w in params["layers"].items()}
    top = {n: w for n, w in params.items() if n != "layers"}
    top = jax.tree.map(jax.lax.with_sharding_constraint, top, sl.top_shardings(layout, specs))
    micro = split_microbatches(batch, m)

    # Manual over `stage` and the batch axes: each device accumulates the gradients of its own rows
    # through the whole tick loop, and they are summed over the batch axes once, after it.
    batch_axes = manual_batch_axes(layout)

    in_layers = {n: sl.region_spec(layout, a) for n, a in stacked_axes.items()}
    # each leaf's gradient is summed over the batch axes that do not split it (experts: data x fsdp)
    reduce_over = {n: sl.unsplit(batch_axes, s) for n, s in in_layers.items()}
    tokens = sl.microbatch_tokens(micro)
    trained = [n for n, spec in specs["layers"].items() if spec.trainable]
    top_in = sl.top_region_specs(layout, specs)  # whole, but MTP's experts (split over `expert`)
    top_out = partition(top_in, top_mask := trainable_mask(sl.top_specs(specs)))[0]  # the trained ones' gradients

    def body(stacked, top, micro, tokens, ids, key_arr=None):
        local = jax.tree.map(lambda w: w[0], stacked)  # [v, c, ...]
        stage = _Stage(cfg, layout, tab, local, top, micro, key_arr, idle_fill, tokens, ids[0])
        rows = jax.tree.map(jnp.asarray, tab.rows)
        c, _ = jax.lax.scan(stage.tick, stage.carry(), rows)
        total = lambda t: jax.lax.psum(t, (AXIS, *batch_axes))
        g_layers = {n: jax.lax.psum(g, reduce_over[n])[None] for n, g in c.g_layers.items()}
        # each weight outside the layers: summed over the stages and the batch axes that do not split it
        over = lambda g, s: jax.lax.psum(g, (AXIS, *sl.unsplit(batch_axes, s)))
        g_top = [over(g, s) for g, s in zip(c.g_top, top_out, strict=True)]
        out = g_layers, g_top, total(c.loss), total(c.count), total(c.mtp)
        stats = {n: jax.tree.map(lambda a: a[None, :m], s) for n, s in c.moe.items() if "stats" in n} if c.moe else None
        return *out, stats

    ids = jnp.asarray(sl.layer_ids(cfg, slots)[np.asarray(schedule.held_chunks())])  # [p, v, c]
    args = (stacked, top, micro, tokens, ids) + ((key,) if key is not None else ())
    rows_split = P(None, batch_axes or None)  # every microbatch array is [m, b, ...]
    region = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=({n: in_layers[n] for n in stacked}, top_in, rows_split, P(), P(AXIS)) + ((P(),) * (key is not None)),
        out_specs=({n: in_layers[n] for n in trained}, top_out, P(), P(), P(), sl.stats_specs(cfg, batch_axes)),
        axis_names={AXIS, *batch_axes},
        check_vma=False,
    )
    g_layers, g_top, loss_sum, count, mtp_sums, stats = region(*args)

    ungroup = lambda n: sl.ungroup_stored(g_layers[n], specs["layers"][n], schedule, slots, layout)
    # frozen leaves (LoRA's base): zeros, constants in the returned tree, as `step.gradients` gives them
    layers = {n: ungroup(n) if n in g_layers else jnp.zeros_like(w) for n, w in params["layers"].items()}
    _, frozen, join = partition(sl.top_specs(params), top_mask)
    top = join(g_top, [jnp.zeros_like(w) for w in frozen])  # LoRA's base; an MTP module's router bias
    metrics = sl.moe_metrics(stats, cfg, schedule) | ({"mtp_loss_sum": mtp_sums} if cfg.model.mtp_depth else {})
    return sl.unstaged({"layers": layers, **top}, cfg.model), loss_sum, count, metrics
