"""AdamW with warmup + cosine decay and global-norm clipping (optax). Optimizer state is sharded
exactly like the parameters it mirrors (ZeRO-style under FSDP); scalars are replicated."""

from __future__ import annotations

import optax

from meshlm.config import OptimConfig
from meshlm.model.params import map_specs


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    decay_steps = max(total_steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=decay_steps,
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: OptimConfig, total_steps: int, specs: dict) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW; weight decay only on weight matrices (`ParamSpec.decay`)."""
    decay_mask = map_specs(lambda s: s.decay, specs)
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
