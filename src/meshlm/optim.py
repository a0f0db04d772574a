"""AdamW with warmup + cosine decay and global-norm clipping (optax). Optimizer state is sharded
exactly like the parameters it mirrors (ZeRO-style under FSDP); scalars are replicated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from meshlm.config import OptimConfig
from meshlm.model.params import map_specs


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate of update k (0-based): a linear warmup that starts at lr/w, not 0 (Megatron:
    the first update is not wasted), reaching lr at update w-1; then a cosine from lr down to
    `min_lr_ratio * lr` at the last update (`total_steps` - 1), held there beyond it."""
    w = cfg.warmup_steps
    decay_steps = max(total_steps - w, 1)
    end = cfg.lr * cfg.min_lr_ratio

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = cfg.lr * (count + 1) / max(w, 1)
        progress = jnp.clip((count + 1 - w) / decay_steps, 0.0, 1.0)
        cosine = end + (cfg.lr - end) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(count < w, warm, cosine)

    return schedule


def make_optimizer(cfg: OptimConfig, total_steps: int, specs: dict) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW; weight decay only on weight matrices (`ParamSpec.decay`).
    Frozen parameters (LoRA's base, `ParamSpec.trainable`) get neither: no update and no optimizer
    state (optax's set_to_zero keeps none), and the clipping norm is the trainable ones'."""
    decay_mask = map_specs(lambda s: s.decay, specs)
    train = _adamw(cfg, total_steps, decay_mask)
    if all(jax.tree.leaves(map_specs(lambda s: s.trainable, specs))):
        return train
    labels = map_specs(lambda s: "train" if s.trainable else "frozen", specs)
    return optax.multi_transform({"train": train, "frozen": optax.set_to_zero()}, labels)


def _adamw(cfg: OptimConfig, total_steps: int, decay_mask) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            lr_schedule(cfg, total_steps),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        ),
    )
