"""Pipeline parallelism: GPipe, 1F1B and interleaved 1F1B inside the one jitted train step.

The schedule is data (`parallel.schedules`): a static table of (tick, stage) -> forward or
backward of one microbatch through one model chunk, or idle. `tables` turns it into integer
arrays - what each stage does at each tick, and which buffer slot it reads and writes - and
`pipeline_gradients` runs them: one `lax.scan` over ticks inside a `shard_map` that is manual
over the `stage` axis only (data, fsdp, tensor and sequence parallelism stay what they are
inside each stage: GSPMD plus the tensor-parallel regions, which become manual over the
remaining axes).

At each tick every stage takes one branch of a `lax.switch` on its own action:

- forward F(i, c): its input is the embedded microbatch (first chunk) or the activation that
  arrived from the previous stage; `jax.vjp` of the chunk's layers gives the output and the
  residuals the remat policy keeps, which are stashed in a slot until B(i, c) - exactly what
  one device's autodiff would keep for those layers, so every remat policy means what it means
  without pipelining. On the last chunk the output layer and loss run at once, forward and
  backward, and the output's cotangent waits for B(i, c) (the pipeline output is not kept).
- backward B(i, c): the stashed residuals and the arrived cotangent give the chunk's weight
  gradients (accumulated in the carry) and its input cotangent, which goes to the previous stage
  (or, on the first chunk, back through the embedding).
- idle: nothing.

Then every stage, whatever it did, sends its outgoing activation to the next stage and its
outgoing cotangent to the previous one (two `ppermute`s, entered by all devices on every tick,
outside any branch); the receiver files them into the slot the table names. Collectives inside
a branch (tensor parallelism, GSPMD's data-parallel reduction of each backward tick's chunk
gradients) are those of one stage's devices, which all take the same branch.

Buffers are slot arrays whose sizes come from the table: the stash holds the schedule's peak
number of microbatch-chunks in flight (GPipe m, 1F1B min(p, m) on stage 0), the inboxes what has
arrived and not yet been used. Slots are assigned in Python by interval colouring, so nothing
is searched at run time. Every buffer is read before the switch and written after it (in place);
an inbox's spare last slot takes what an idle neighbour sends.

Weights: the stacked layer axis [L, ...] is sharded over `stage` in contiguous blocks (the rules
table), so checkpoints do not depend on the pipeline. Inside the step it is viewed as
[v, p, L/(pv), ...] and regrouped to [p, v, L/(pv), ...], giving stage s its chunks s, s+p, ...
(no data moves when v = 1; with v > 1 the chunks not already on their stage move in, and their
gradients back, once per step: 6 of 8 at p = 4, v = 2). With FSDP, a stage's weights are gathered
once per step before the region. Embedding, positions, final norm and output layer are
replicated over `stage` (used by the first and last stages); their gradients are summed over it.

Dropout: microbatch i draws from fold_in(key, i) and layer l from fold_in(that, l), as the
accumulation loop of `step.gradients` does, so a pipelined step equals the unpipelined one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm import axes as ax
from meshlm.config import RunConfig
from meshlm.model.loss import cross_entropy_sum
from meshlm.model.params import param_specs
from meshlm.model.transformer import RESIDUAL, embed, logits, run_layers
from meshlm.parallel.rules import Layout, constrain
from meshlm.parallel.schedules import BACKWARD, FORWARD, IDLE, Schedule, build, tables

AXIS = "stage"


def schedule_for(cfg: RunConfig) -> Schedule:
    par = cfg.parallel
    return build(par.pipeline_schedule, par.stage, cfg.train.microbatches, par.virtual_stages)


def _zeros(shape: tuple[int, ...], like: jax.ShapeDtypeStruct, fill: float, host: bool = False) -> jax.Array:
    """A slot buffer for residual leaves like `like`: floats hold `fill`, PRNG keys (the dropout
    keys a recomputed region keeps) key(0). `host`: the residual lives in host memory (the
    `offload` policy), and so does its buffer."""
    if host:
        return jax.device_put(_zeros(shape, like, fill), jax.memory.Space.Host)
    if jax.dtypes.issubdtype(like.dtype, jax.dtypes.prng_key):
        keys = jnp.broadcast_to(jax.random.key(0), shape + like.shape)
        if keys.dtype != like.dtype:
            raise TypeError(f"the pipeline stash holds keys of the default PRNG ({keys.dtype}), not {like.dtype}")
        return keys
    if jnp.issubdtype(like.dtype, jnp.floating):
        return jnp.full(shape + like.shape, fill, like.dtype)
    return jnp.zeros(shape + like.shape, like.dtype)


def _kept(layout: Layout, logical: str | None) -> str | None:
    """The mesh axis a weight dimension keeps inside the pipeline: `stage` or `tensor`, not fsdp."""
    names = [a for a in layout.mesh_axes(logical) if a in (AXIS, "tensor")]
    return names[0] if names else None


def _put(buf: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    value = value if value.dtype == buf.dtype else value.astype(buf.dtype)
    return jax.lax.dynamic_update_index_in_dim(buf, value, slot, 0)


def _take(buf: jax.Array, slot: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)


def pipeline_gradients(
    params: dict,
    batch: dict,
    key: jax.Array | None,
    cfg: RunConfig,
    layout: Layout,
    split_microbatches,
    idle_fill: float = 0.0,
):
    """(summed gradients, summed token loss, token count) of one global batch through the
    pipeline, as `step.gradients` computes them without one (before its division by the count).

    `split_microbatches(batch, m)` gives [m, b/m, ...] arrays. `idle_fill` is what idle stages
    send and what empty slots hold (tests fill them with NaN to show that bubbles are inert)."""
    schedule = schedule_for(cfg)
    tab = tables(schedule)
    p, v, m = schedule.stages, schedule.virtual, schedule.microbatches
    mcfg, policy = cfg.model, cfg.remat.policy
    per_chunk = mcfg.n_layers // (p * v)
    dtype = jnp.dtype(mcfg.dtype)

    def regroup(w):  # [L, ...] -> [p, v, L/(pv), ...]: stage s gets chunks s, s+p, ...
        return jnp.swapaxes(w.reshape(v, p, per_chunk, *w.shape[1:]), 0, 1)

    specs = param_specs(mcfg)
    top_axes = {n: spec.axes for n, spec in specs.items() if n != "layers"}
    # FSDP inside a pipeline: each stage's weights are gathered once per step (not once per tick),
    # their gradients reduce-scattered once at the end (the caller's constraint). Only the stage
    # and tensor splits remain inside.
    keep = lambda axes: NamedSharding(layout.mesh, P(*(_kept(layout, a) for a in axes)))
    stacked = {
        n: jax.lax.with_sharding_constraint(regroup(w), keep((ax.LAYERS, None, None, *specs["layers"][n].axes[1:])))
        for n, w in params["layers"].items()
    }
    top = {n: jax.lax.with_sharding_constraint(w, keep(top_axes[n])) for n, w in params.items() if n != "layers"}
    micro = split_microbatches(batch, m)
    b, s_len = micro["inputs"].shape[1:3]
    x_shape = (b, s_len, mcfg.d_model)

    def chunk_fn(w, x, k, ids, seg):
        return run_layers(x, w, ids, mcfg, layout, k, policy, seg)[0]

    def embed_fn(top, mb, k):
        return embed(top, mb["inputs"], mcfg, layout, k, mb.get("positions"))

    def loss_fn(y, top, mb):
        out = logits(top, y, mcfg, layout, policy)
        return cross_entropy_sum(out, mb["targets"], mb.get("mask"))

    def body(stacked, top, micro, key_arr):
        stage = jax.lax.axis_index(AXIS)
        local = jax.tree.map(lambda w: w[0], stacked)  # [v, L/(pv), ...]
        rows = jax.tree.map(jnp.asarray, tab.rows)
        pick = lambda tree, i: jax.tree.map(lambda a: _take(a, i), tree)
        resid = lambda x: constrain(layout, x, RESIDUAL)
        top_layout = lambda tree: {n: jax.lax.with_sharding_constraint(w, keep(top_axes[n])) for n, w in tree.items()}

        def chunk_weights(lc):  # cast before the vjp, so residual weights are these very arrays
            return jax.tree.map(lambda w: w.astype(dtype), pick(local, lc))

        def mb_key(i):
            if key_arr is None:
                return None
            return key_arr if m == 1 else jax.random.fold_in(key_arr, i)

        def vjp_parts(w, x, k, ids, seg):
            """The chunk's output, its vjp, and which residuals are the chunk's weights themselves
            (index into w's leaves, else None): those are not stashed but taken again in B."""
            y, vjp_fn = jax.vjp(lambda w, x: chunk_fn(w, x, k, ids, seg), w, x)
            w_leaves = jax.tree.leaves(w)
            where = tuple(next((j for j, q in enumerate(w_leaves) if q is r), None) for r in jax.tree.leaves(vjp_fn))
            return y, vjp_fn, where

        probe = {}  # what eval_shape's trace saw: which residuals are weights, and where each lives

        def residual_shapes(w, x):
            _, vjp_fn, probe["where"] = vjp_parts(
                w, x, mb_key(0), jnp.arange(per_chunk), pick(micro, 0).get("segment_ids")
            )
            probe["host"] = [jax.typeof(r).memory_space == jax.memory.Space.Host for r in jax.tree.leaves(vjp_fn)]
            return vjp_fn

        w0 = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], dtype), local)
        leaves, treedef = jax.tree.flatten(jax.eval_shape(residual_shapes, w0, jax.ShapeDtypeStruct(x_shape, dtype)))
        where = probe["where"]
        stashed = [(leaf, host) for leaf, j, host in zip(leaves, where, probe["host"], strict=True) if j is None]

        def stash_of(vjp_fn, w_where):
            if w_where != where:
                raise AssertionError("the chunk's residuals changed structure between traces")
            return [leaf for leaf, j in zip(jax.tree.leaves(vjp_fn), where, strict=True) if j is None]

        def rebuilt_vjp(res, lc):
            w_leaves, it = jax.tree.leaves(chunk_weights(lc)), iter(res)
            return jax.tree.unflatten(treedef, [next(it) if j is None else w_leaves[j] for j in where])

        inbox = lambda n: constrain(layout, jnp.full((n, *x_shape), idle_fill, dtype), (None, *RESIDUAL))
        carry = {
            "act": inbox(tab.act_slots),
            "grad": inbox(tab.grad_slots),
            "stash": [_zeros((tab.stash_slots,), leaf, idle_fill, host) for leaf, host in stashed],
            "g_layers": jax.tree.map(jnp.zeros_like, local),
            "g_top": jax.tree.map(jnp.zeros_like, top),
            "loss": jnp.zeros((), jnp.float32),
            "count": jnp.zeros((), jnp.float32),
        }
        filled = lambda: resid(jnp.full(x_shape, idle_fill, dtype))
        no_grads = lambda: (jax.tree.map(jnp.zeros_like, pick(local, 0)), jax.tree.map(jnp.zeros_like, top))
        zero = jnp.zeros((), jnp.float32)

        # The branches only compute: every buffer is read before the switch and written after it,
        # so XLA updates the loop's buffers in place instead of copying them through a conditional.
        # Each returns (residuals to stash, activation to send, cotangent to send, the loss's
        # cotangent to file, chunk weight gradients, top gradients, loss, token count).
        def context(r):
            ids = (r["chunk"] * p + stage) * per_chunk + jnp.arange(per_chunk)
            return pick(micro, r["micro"]), mb_key(r["micro"]), ids

        def idle(x_in, dy_in, res_in, r):
            return res_in, filled(), filled(), filled(), *no_grads(), zero, zero

        def forward(x_in, dy_in, res_in, r):
            mb, k, ids = context(r)
            first, last = r["first"].astype(bool), r["last"].astype(bool)
            # both branches of every cond state their outputs' layout (XLA requires them equal)
            x = jax.lax.cond(first, lambda: resid(embed_fn(top, mb, k).astype(dtype)), lambda: resid(x_in))
            y, vjp_fn, w_where = vjp_parts(chunk_weights(r["chunk"]), x, k, ids, mb.get("segment_ids"))

            def with_loss():
                (ls, cnt), (dy, dtop) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(y, top, mb)
                return resid(dy.astype(dtype)), top_layout(dtop), ls, cnt

            dy, dtop, ls, cnt = jax.lax.cond(last, with_loss, lambda: (filled(), top_layout(no_grads()[1]), zero, zero))
            send = jnp.where(last, filled(), resid(y.astype(dtype)))
            return stash_of(vjp_fn, w_where), send, filled(), dy, no_grads()[0], dtop, ls, cnt

        def backward(x_in, dy_in, res_in, r):
            mb, k, _ = context(r)
            dw, dx = rebuilt_vjp(res_in, r["chunk"])(resid(dy_in))
            dw = jax.tree.map(lambda g: g.astype(jnp.float32), dw)

            def through_embedding():
                _, vjp_embed = jax.vjp(lambda t: embed_fn(t, mb, k).astype(dtype), top)
                return top_layout(vjp_embed(dx)[0])

            first = r["first"].astype(bool)
            dtop = jax.lax.cond(first, through_embedding, lambda: top_layout(no_grads()[1]))
            send = jnp.where(first, filled(), resid(dx.astype(dtype)))
            return res_in, filled(), send, filled(), dw, dtop, zero, zero

        right = [(j, (j + 1) % p) for j in range(p)]
        left = [(j, (j - 1) % p) for j in range(p)]

        def tick(c, row):
            r = {k: _take(a, stage) for k, a in row.items()}
            reads = (
                _take(c["act"], r["act_read"]),
                _take(c["grad"], r["grad_read"]),
                [_take(buf, r["stash"]) for buf in c["stash"]],
            )
            branches = {IDLE: idle, FORWARD: forward, BACKWARD: backward}
            res, send_act, send_grad, dy, dw, dtop, ls, cnt = jax.lax.switch(
                r["kind"], [branches[k] for k in sorted(branches)], *reads, r
            )
            lc = r["chunk"]
            got_act = jax.lax.ppermute(send_act, AXIS, right)
            got_grad = jax.lax.ppermute(send_grad, AXIS, left)
            grad = _put(c["grad"], r["grad_write"], dy)
            return {
                "act": _put(c["act"], r["recv_act"], got_act),
                "grad": _put(grad, r["recv_grad"], got_grad),
                "stash": [_put(buf, r["stash"], leaf) for buf, leaf in zip(c["stash"], res, strict=True)],
                "g_layers": jax.tree.map(lambda acc, g: _put(acc, lc, _take(acc, lc) + g), c["g_layers"], dw),
                "g_top": jax.tree.map(jnp.add, c["g_top"], dtop),
                "loss": c["loss"] + ls,
                "count": c["count"] + cnt,
            }, None

        c, _ = jax.lax.scan(tick, carry, rows)
        total = lambda t: jax.lax.psum(t, AXIS)
        g_layers = jax.tree.map(lambda g: g[None], c["g_layers"])
        return g_layers, jax.tree.map(total, c["g_top"]), total(c["loss"]), total(c["count"])

    args = (stacked, top, micro) + ((key,) if key is not None else ())
    fn = body if key is not None else (lambda st, tp, mi: body(st, tp, mi, None))
    region = jax.shard_map(
        fn,
        mesh=layout.mesh,
        in_specs=(P(AXIS), P(), P()) + ((P(),) if key is not None else ()),
        out_specs=(P(AXIS), P(), P(), P()),
        axis_names={AXIS},
        check_vma=False,
    )
    g_layers, g_top, loss_sum, count = region(*args)
    n_layers = mcfg.n_layers

    def ungroup(g):  # [p, v, L/(pv), ...] -> [L, ...]
        return jnp.swapaxes(g, 0, 1).reshape(n_layers, *g.shape[3:])

    grads = {"layers": jax.tree.map(ungroup, g_layers), **g_top}
    return grads, loss_sum, count
