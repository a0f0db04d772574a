"""The one jitted train step and the eval step.

`make_train_step` returns `step(state, batch) -> (state, metrics)`, compiled once with explicit
input/output shardings and the state donated. Gradient accumulation runs inside it as a
`lax.scan` over microbatches, so k microbatches cost one compile and give the same update as one
step on the whole batch (losses are summed and divided once by the token count).

RNG: the dropout key of step n is fold_in(key(seed), n) (and of microbatch i, fold_in of that
with i), so a resumed run draws the same bits without saving any RNG state.

`gradients` is the one place gradients are computed; `make_grad_step` exposes it (jitted with the
step's shardings) so tests compare raw gradients across layouts, before Adam and clipping could
hide a constant factor on a leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import optax

from meshlm import axes as ax
from meshlm.config import RunConfig
from meshlm.model import mtp
from meshlm.model.moe import MOE_METRICS, moe_losses, over_microbatches, update_router_bias, without_capacity
from meshlm.model.params import param_specs, partition, trainable_mask
from meshlm.model.transformer import forward, output_loss
from meshlm.optim import lr_schedule
from meshlm.parallel.pipeline import pipeline_gradients
from meshlm.parallel.rules import Layout
from meshlm.train_state import TrainState, zero1_sharding

# {"inputs": int32 [B, S], "targets": int32 [B, S]}, and with document masking also
# "segment_ids" and "positions" (int32 [B, S]); every entry is sharded like the inputs.
Batch = dict[str, jax.Array]


def batch_sharding(layout: Layout):
    """Rows over (data, fsdp), the sequence over `context` (stored in context order, see the loader)."""
    return layout.sharding((ax.BATCH, ax.SEQ))


BATCH_KEYS = ("inputs", "targets")
DOCUMENT_KEYS = ("segment_ids", "positions")


def abstract_batch(cfg: RunConfig, layout: Layout) -> Batch:
    """Shapes and shardings of one global batch (for ahead-of-time compilation)."""
    keys = BATCH_KEYS + (DOCUMENT_KEYS if cfg.data.document_mask else ()) + (("mask",) if cfg.data.loss_mask else ())
    shape = (cfg.train.global_batch, cfg.train.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(layout)) for k in keys}


def _forward(params, batch: Batch, cfg: RunConfig, layout: Layout, key=None, remat_policy: str = "elementwise", **kw):
    return forward(
        params,
        batch["inputs"],
        cfg.model,
        layout,
        key=key,
        remat_policy=remat_policy,
        segment_ids=batch.get("segment_ids"),
        positions=batch.get("positions"),
        **kw,
    )


def _loss_head(params, batch: Batch, cfg: RunConfig, layout: Layout, policy: str) -> Callable:
    """The output layer and loss as the forward's head: (loss sum, token count) in place of the logits."""
    targets, mask, chunks = batch["targets"], batch.get("mask"), cfg.remat.loss_chunks
    return partial(
        output_loss, params, targets=targets, mask=mask, cfg=cfg.model, layout=layout, policy=policy, chunks=chunks
    )


def objective_sum(params, batch: Batch, cfg: RunConfig, layout: Layout, key):
    """(objective summed over the microbatch's tokens, (cross-entropy sum, token count, metrics)).

    MoE: the objective adds count x (aux_coef x load-balancing loss + z_coef x z-loss), so that after
    the one division by the batch's token count each microbatch's router losses weigh as its tokens.
    MTP (`model.mtp`): it adds mtp_loss_coef / D x the modules' loss sums (DeepSeek-V3's 1/T: the same
    division), reported apart as `mtp_loss_sum` [D]; their MoE layers' statistics join the model's."""
    m, policy, chunks = cfg.model, cfg.remat.policy, cfg.remat.loss_chunks
    kw = {"hidden": True} if m.mtp_depth else {"router_stats": True} if m.moe else {}
    out = _forward(params, batch, cfg, layout, key, policy, head=_loss_head(params, batch, cfg, layout, policy), **kw)
    (ce, count), stats, x = out if m.mtp_depth else (*out, None) if m.moe else (out, None, None)
    objective, metrics = ce, {}
    if m.mtp_depth:
        sums, mtp_stats = mtp.objective(params, x, batch, m, layout, key, policy, chunks)
        objective += mtp.weighted(sums, m)
        metrics["mtp_loss_sum"] = sums
        if mtp_stats is not None:  # the modules' MoE layers after the model's
            stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, mtp_stats)
    if m.moe:
        metrics |= moe_losses(stats, m)
        router = m.moe_aux_loss_coef * metrics["moe_aux_loss"] + m.moe_z_loss_coef * metrics["moe_z_loss"]
        objective += count * (router + m.moe_seq_aux_loss_coef * metrics["moe_seq_aux_loss"])
    return objective, (ce, count, metrics)


def _split_microbatches(batch: Batch, k: int, layout: Layout) -> Batch:
    """[B, S] -> [k, B/k, S] taking rows i, i+k, i+2k... into microbatch i, so that every
    microbatch stays spread over all batch shards (a plain reshape would put microbatch 0 on
    the first devices only)."""

    def split(x):
        b = x.shape[0]
        x = x.reshape(b // k, k, *x.shape[1:]).swapaxes(0, 1)
        return layout.constrain(x, (None, ax.BATCH, ax.SEQ) + (None,) * (x.ndim - 3))

    return jax.tree.map(split, batch)


def dropout_key(cfg: RunConfig, step: jax.Array | int) -> jax.Array | None:
    """The dropout key of step `step` (None without dropout, model.dropout or LoRA's): fold_in(key(seed), step)."""
    return jax.random.fold_in(jax.random.key(cfg.train.seed), step) if cfg.model.stochastic else None


def gradients(params: dict, batch: Batch, key, cfg: RunConfig, layout: Layout, param_shardings: dict):
    """(raw gradients, mean token loss, token count, MoE metrics averaged over the microbatches) of
    one global batch, before any optimizer. The loss is the cross-entropy; the gradient also has the
    MoE router losses' (`objective_sum`).

    The gradient is of the mean loss over every counted token of the batch. With k microbatches it
    is accumulated in a `lax.scan` (microbatch i uses dropout key fold_in(key, i)) and divided once
    by the whole batch's token count, so k microbatches give the gradient of the whole batch.
    This is the one gradient path: the train step applies the optimizer to what it returns, and
    the equivalence tests compare what it returns across layouts.
    """
    k = cfg.train.microbatches
    if layout.stage_size > 1:  # the microbatches flow through the pipeline's stages instead
        split = lambda b, m: _split_microbatches(b, m, layout)
        grads, loss_sum, count, moe_metrics = pipeline_gradients(params, batch, key, cfg, layout, split)
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        denom = jnp.maximum(count, 1.0)  # a loss-masked batch without a trained token: zero, not 0/0
        return jax.tree.map(lambda g: g / denom, grads), loss_sum / denom, count, _mtp_losses(moe_metrics, denom)
    # LoRA: only the trainable leaves are differentiated, so the frozen weights' gradients (their
    # d_in x d_out GEMMs) are never computed; they are zeros (constants) in the returned tree
    mask = trainable_mask(param_specs(cfg.model))
    trainable, frozen, join = partition(params, mask)
    train_shardings, _, _ = partition(param_shardings, mask)
    grad_fn = jax.grad(lambda t, b, key: objective_sum(join(t, frozen), b, cfg, layout, key), has_aux=True)
    if k == 1:
        grads, (loss_sum, count, moe_metrics) = grad_fn(trainable, batch, key)
    else:

        def accumulate(carry, xs):
            g_acc, l_acc, c_acc = carry
            mb, i = xs
            mkey = None if key is None else jax.random.fold_in(key, i)
            g, (loss_i, count_i, metrics_i) = grad_fn(trainable, mb, mkey)
            g_acc = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, g_acc, g), train_shardings)
            return (g_acc, l_acc + loss_i, c_acc + count_i), metrics_i

        zeros = jax.tree.map(jnp.zeros_like, trainable)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        micro = _split_microbatches(batch, k, layout)
        (grads, loss_sum, count), per_micro = jax.lax.scan(accumulate, init, (micro, jnp.arange(k)))
        moe_metrics = over_microbatches(per_micro)
    denom = jnp.maximum(count, 1.0)  # a loss-masked batch without a trained token: zero, not 0/0
    grads = join(jax.tree.map(lambda g: g / denom, grads), [jnp.zeros_like(f) for f in frozen])
    return grads, loss_sum / denom, count, _mtp_losses(moe_metrics, denom)


def _mtp_losses(metrics: dict, denom: jax.Array) -> dict:
    """Each MTP module's loss, DeepSeek-V3's L_k, from its loss sum (`mtp_loss_sum`, if any)."""
    if "mtp_loss_sum" not in metrics:
        return metrics
    return {k: v for k, v in metrics.items() if k != "mtp_loss_sum"} | {"mtp_loss": metrics["mtp_loss_sum"] / denom}


def make_grad_step(cfg: RunConfig, layout: Layout, param_shardings: dict) -> Callable:
    """`grads(params, batch, step) -> {"grads", "loss", "grad_norm"}` jitted with the train step's
    shardings: exactly the gradients the train step would hand to the optimizer at `step`."""

    def fn(params, batch, step):
        grads, loss, _, moe_metrics = gradients(params, batch, dropout_key(cfg, step), cfg, layout, param_shardings)
        return {"grads": grads, "loss": loss, "grad_norm": optax.tree.norm(grads)} | moe_metrics

    out = {"grads": param_shardings} | dict.fromkeys(("loss", "grad_norm", *MOE_METRICS), layout.replicated())
    if not cfg.model.moe:
        out = {k: v for k, v in out.items() if k not in MOE_METRICS}
    if cfg.model.mtp_depth:
        out["mtp_loss"] = layout.replicated()
    return jax.jit(fn, in_shardings=(param_shardings, batch_sharding(layout), None), out_shardings=out)


def _optimizer_update(cfg: RunConfig, layout: Layout, tx: optax.GradientTransformation, shardings: TrainState):
    """`update(grads, state) -> (new params, new optimizer state, the old one on the device)`.

    Plain: optax's update on the parameters' layout. `optim.offload_state`: the optimizer state comes
    from host memory to the device first (its shardings' memory kind; the caller sends the new state
    back). `parallel.shard_optimizer` (ZeRO-1): gradients and weights are taken at the moments'
    sharding, so each device updates only its shard (XLA may then reduce the gradients with a
    reduce-scatter instead of an all-reduce; XLA:CPU keeps the all-reduce and slices), and the new
    weights are all-gathered back to the parameters' layout."""
    on_device = jax.tree.map(lambda sh: sh.with_memory_kind("device"), shardings.opt_state)

    def update(grads, state: TrainState):
        old = jax.device_put(state.opt_state, on_device) if cfg.optim.offload_state else state.opt_state
        params = state.params
        if cfg.parallel.shard_optimizer:
            shard = lambda tree: jax.tree.map(
                lambda x, sh: jax.lax.with_sharding_constraint(x, zero1_sharding(layout, sh, x.shape)),
                tree,
                shardings.params,
            )
            grads, params = shard(grads), shard(params)
        updates, opt_state = tx.update(grads, old, params)
        new = jax.lax.with_sharding_constraint(optax.apply_updates(params, updates), shardings.params)
        return new, opt_state, old

    return update


def make_train_step(
    cfg: RunConfig,
    layout: Layout,
    tx: optax.GradientTransformation,
    shardings: TrainState,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """The jitted train step. Non-finite steps follow `train.on_nonfinite` without a host sync:

    - the update of a step whose loss or gradient norm is not finite is never applied;
    - `skip`: the batch counts as consumed (`step` + 1, `skipped` + 1, `streak` + 1) and training
      goes on, until more than `train.max_consecutive_skips` steps in a row are non-finite;
    - `stop` (and a streak too long for `skip`): the state freezes at the last good step and
      `halted` is set; every later step is a no-op until the host, at its next sync point, sees
      `halted`, checkpoints the last good state and stops, naming the step.

    So `step` is always the data position (batch n = f(seed, n)), `step - skipped` the number of
    optimizer updates (optax's own count and the learning-rate schedule follow it), and a
    checkpoint taken at any time resumes exactly.
    """
    schedule = lr_schedule(cfg.optim, cfg.train.steps)
    allowed = cfg.train.max_consecutive_skips if cfg.train.on_nonfinite == "skip" else 0

    update = _optimizer_update(cfg, layout, tx, shardings)

    def step(state: TrainState, batch: Batch):
        key = dropout_key(cfg, state.step)
        grads, loss, count, moe_metrics = gradients(state.params, batch, key, cfg, layout, shardings.params)
        grad_norm = optax.tree.norm(grads)
        params, opt_state, old_opt_state = update(grads, state)
        if cfg.model.moe:  # DeepSeek-V3's router bias, moved by this step's load (outside the gradient)
            params = update_router_bias(params, moe_metrics["expert_counts"], cfg.model)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        running = jnp.logical_not(state.halted)
        apply = running & finite
        halt = running & ~finite & (state.streak >= allowed)
        skip = running & ~finite & ~halt
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)
        new_state = TrainState(
            step=state.step + (apply | skip).astype(jnp.int32),
            params=keep(params, state.params),
            opt_state=keep(opt_state, old_opt_state),
            skipped=state.skipped + skip.astype(jnp.int32),
            streak=jnp.where(apply, 0, state.streak + skip.astype(jnp.int32)),
            halted=state.halted | halt,
        )
        if cfg.optim.offload_state:  # back to host memory
            new_state = new_state._replace(opt_state=jax.device_put(new_state.opt_state, shardings.opt_state))
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(state.step - state.skipped),  # the rate this step's update used
            "tokens": count,
            "applied": apply,
            "skipped": new_state.skipped,
            "halted": new_state.halted,
        } | moe_metrics
        return new_state, metrics

    return jax.jit(
        step,
        in_shardings=(shardings, batch_sharding(layout)),
        out_shardings=(shardings, layout.replicated()),
        donate_argnums=(0,),
    )


def make_eval_step(cfg: RunConfig, layout: Layout, param_shardings: dict) -> Callable:
    """`eval(params, batch) -> (loss_sum, token_count)`, deterministic (no dropout); MoE routes
    without a capacity limit, as generation does (`moe.without_capacity`)."""
    cfg = dataclasses.replace(cfg, model=without_capacity(cfg.model))

    def evaluate(params, batch: Batch):
        return _forward(params, batch, cfg, layout, head=_loss_head(params, batch, cfg, layout, "elementwise"))

    return jax.jit(
        evaluate,
        in_shardings=(param_shardings, batch_sharding(layout)),
        out_shardings=layout.replicated(),
    )
