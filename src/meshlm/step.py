"""The one jitted train step and the eval step.

`make_train_step` returns `step(state, batch) -> (state, metrics)`, compiled once with explicit
input/output shardings and the state donated. Gradient accumulation runs inside it as a
`lax.scan` over microbatches, so k microbatches cost one compile and give the same update as one
step on the whole batch (losses are summed and divided once by the token count).

RNG: the dropout key of step n is fold_in(key(seed), n) (and of microbatch i, fold_in of that
with i), so a resumed run draws the same bits without saving any RNG state.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from meshlm import axes as ax
from meshlm.config import RunConfig
from meshlm.model.loss import cross_entropy_sum
from meshlm.model.transformer import forward
from meshlm.optim import lr_schedule
from meshlm.parallel.rules import Layout
from meshlm.train_state import TrainState

# {"inputs": int32 [B, S], "targets": int32 [B, S]}, and with document masking also
# "segment_ids" and "positions" (int32 [B, S]); every entry is sharded like the inputs.
Batch = dict[str, jax.Array]


def batch_sharding(layout: Layout):
    return layout.sharding((ax.BATCH, None))


BATCH_KEYS = ("inputs", "targets")
DOCUMENT_KEYS = ("segment_ids", "positions")


def abstract_batch(cfg: RunConfig, layout: Layout) -> Batch:
    """Shapes and shardings of one global batch (for ahead-of-time compilation)."""
    keys = BATCH_KEYS + (DOCUMENT_KEYS if cfg.data.document_mask else ())
    shape = (cfg.train.global_batch, cfg.train.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(layout)) for k in keys}


def _forward(params, batch: Batch, cfg: RunConfig, layout: Layout, key=None, remat_policy: str = "none"):
    return forward(
        params,
        batch["inputs"],
        cfg.model,
        layout,
        key=key,
        remat_policy=remat_policy,
        segment_ids=batch.get("segment_ids"),
        positions=batch.get("positions"),
    )


def _loss_sum(params, batch: Batch, cfg: RunConfig, layout: Layout, key):
    logits = _forward(params, batch, cfg, layout, key, cfg.remat.policy)
    return cross_entropy_sum(logits, batch["targets"], batch.get("mask"))


def _split_microbatches(batch: Batch, k: int, layout: Layout) -> Batch:
    """[B, S] -> [k, B/k, S] taking rows i, i+k, i+2k... into microbatch i, so that every
    microbatch stays spread over all batch shards (a plain reshape would put microbatch 0 on
    the first devices only)."""

    def split(x):
        b = x.shape[0]
        x = x.reshape(b // k, k, *x.shape[1:]).swapaxes(0, 1)
        return layout.constrain(x, (None, ax.BATCH) + (None,) * (x.ndim - 2))

    return jax.tree.map(split, batch)


def make_train_step(
    cfg: RunConfig,
    layout: Layout,
    tx: optax.GradientTransformation,
    shardings: TrainState,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    k = cfg.train.microbatches
    schedule = lr_schedule(cfg.optim, cfg.train.steps)
    grad_fn = jax.value_and_grad(lambda p, b, key: _loss_sum(p, b, cfg, layout, key), has_aux=True)
    base_key = jax.random.key(cfg.train.seed)
    dropout_on = cfg.model.dropout > 0

    def step(state: TrainState, batch: Batch):
        key = jax.random.fold_in(base_key, state.step) if dropout_on else None
        if k == 1:
            (loss_sum, count), grads = grad_fn(state.params, batch, key)
        else:
            micro = _split_microbatches(batch, k, layout)

            def accumulate(carry, xs):
                g_acc, l_acc, c_acc = carry
                mb, i = xs
                mkey = None if key is None else jax.random.fold_in(key, i)
                (loss_i, count_i), g = grad_fn(state.params, mb, mkey)
                g_acc = jax.tree.map(jnp.add, g_acc, g)
                g_acc = jax.lax.with_sharding_constraint(g_acc, shardings.params)
                return (g_acc, l_acc + loss_i, c_acc + count_i), None

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
            (grads, loss_sum, count), _ = jax.lax.scan(accumulate, init, (micro, jnp.arange(k)))
        grads = jax.tree.map(lambda g: g / count, grads)
        loss = loss_sum / count
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A non-finite loss or gradient leaves the state untouched (the trainer then stops with a
        # clear error), so the last good parameters are never overwritten by NaNs.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = TrainState(
            step=state.step + finite.astype(jnp.int32),
            params=keep(params, state.params),
            opt_state=keep(opt_state, state.opt_state),
        )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "tokens": count,
            "finite": finite,
        }
        return new_state, metrics

    return jax.jit(
        step,
        in_shardings=(shardings, batch_sharding(layout)),
        out_shardings=(shardings, layout.replicated()),
        donate_argnums=(0,),
    )


def make_eval_step(cfg: RunConfig, layout: Layout, param_shardings: dict) -> Callable:
    """`eval(params, batch) -> (loss_sum, token_count)`, deterministic (no dropout)."""

    def evaluate(params, batch: Batch):
        logits = _forward(params, batch, cfg, layout)
        return cross_entropy_sum(logits, batch["targets"], batch.get("mask"))

    return jax.jit(
        evaluate,
        in_shardings=(param_shardings, batch_sharding(layout)),
        out_shardings=layout.replicated(),
    )
