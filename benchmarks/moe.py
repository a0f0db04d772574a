"""Mixture of Experts on this CPU: `moe-tiny`'s train step side by side with what it is compared to.

The shapes are moe-tiny's: 4 layers, d=128, 4 heads and 2 kv heads, 8 SwiGLU experts of width
128, top-2. The run uses vocab 2048, seq 128, batch 16, fp32 and AdamW + clipping. Variants, timed
in alternating rounds in one process:

- meshlm MoE, capacity factor 1.25 (the recipe), on 1 device and on expert=2 (two simulated devices);
- meshlm MoE dropless on the grouped CPU kernel (`model.grouped`, `tiled`: the routed rows and their
  tile padding, 1.25x), on 1 device and on expert=2 (its exchange's worst-case buffers);
- meshlm MoE dropless in capacity buffers (C = t: E/k = 4x the routed FLOPs);
- meshlm dense llama with the same active parameters per token (d_ff = k x 128 = 256);
- `transformers`' `MixtralForCausalLM` (dropless, with its load-balancing loss) on PyTorch CPU eager,
  with the same shapes and optimizer.

The dispatch's share of one MoE layer is itemised with forward + backward of its parts, jitted apart
at the recipe's shapes, as a fraction of the 1-device step: routing (router GEMM, softmax, top-k,
slot assignment), dispatch + combine (the gathers into and out of the capacity buffers), the expert
GEMMs over the buffers, the dropless grouped path (grouping, gathers and the tiled kernel) at
tiles of 64, 128 and 256 rows (`moe_costs.TILE`, chosen from this table), and the expert=2
all_to_alls (two simulated devices: memory copies here, not a network).

    python benchmarks/moe.py [--rounds 5] [--steps 3] [--write] [--one-device]

`--one-device` runs the 1-device variants alone in a process of one CPU device (no expert=2, no
parts). In the two-device process the 1-device steps of the grouped kernel run measurably slower
than they do alone (BENCHMARKS.md gives both).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

if "--one-device" not in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from _markdown import publish
from meshlm import accounting, recipes
from meshlm.config import OptimConfig, ParallelConfig, RunConfig, TrainConfig
from meshlm.model import moe, moe_costs
from meshlm.model.params import init_params, param_specs
from meshlm.platform.hardware import cpu_description
from meshlm.validation import validate
from vs_pytorch import meshlm_stepper, time_variants

VOCAB, SEQ, BATCH = 2048, 128, 16
ONE_DEVICE = "--one-device" in sys.argv  # a process of one CPU device (no expert=2 variants)
LR, B1, B2, WD, CLIP = 3e-4, 0.9, 0.95, 0.1, 1.0


def config(parallel: ParallelConfig | None = None, **model) -> RunConfig:
    parallel = parallel or ParallelConfig()
    base = recipes.get("moe-tiny")
    optim = OptimConfig(lr=LR, warmup_steps=0, b1=B1, b2=B2, weight_decay=WD, clip_norm=CLIP)
    train = TrainConfig(global_batch=BATCH, seq_len=SEQ, steps=10_000)
    m = dataclasses.replace(base.model, vocab_size=VOCAB, **model)
    return validate(RunConfig(model=m, parallel=parallel, optim=optim, train=train))


def mixtral_stepper(cfg: RunConfig):
    m = cfg.model
    hf = transformers.MixtralConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.expert_ffn,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.kv_heads,
        num_local_experts=m.n_experts,
        num_experts_per_tok=m.experts_per_token,
        max_position_embeddings=SEQ,
        output_router_logits=True,
        router_aux_loss_coef=m.moe_aux_loss_coef,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(hf)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2), weight_decay=WD)
    tokens = torch.randint(0, m.vocab_size, (BATCH, SEQ + 1))

    def step():
        out = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    return step, lambda: None


def _timed(fn, *args, rounds: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def layer_parts(cfg: RunConfig) -> dict[str, float]:
    """Seconds of forward + backward of one MoE layer's parts (`model.moe`'s own functions) at the
    recipe's shapes, on one device."""
    m = cfg.model
    p = {k: v[0] for k, v in init_params(param_specs(m), jax.random.key(0))["layers"].items()}
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, m.d_model))
    E, k, C = m.n_experts, m.experts_per_token, moe_costs.expert_capacity(m, SEQ)
    weights, experts, _ = moe.route(jnp.einsum("btd,de->bte", x, p["w_router"]), k, True)
    slot, _ = moe.assign_slots(experts, E, C)

    def routing(x, w):
        weights, experts, probs = moe.route(jnp.einsum("btd,de->bte", x, w), k, m.router_renormalize)
        return jnp.sum(weights) + jnp.sum(probs) + 0.0 * jnp.sum(moe.assign_slots(experts, E, C)[0])

    def dispatch_combine(x):
        return jnp.sum(moe.combine(moe.dispatch(x, slot, E, C), slot, weights) * x)

    def experts_fn(buf, *ws):
        return jnp.sum(moe._swiglu_experts(buf, *ws, moe.layers.swiglu))

    def grouped(x, *ws):  # the dropless path after routing: grouping, gathers, the tiled kernel
        return jnp.sum(moe._grouped_experts(x, experts, *ws, moe.layers.swiglu, "tiled", None, 1))

    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))

    def exchange(buf):  # expert=2: dispatch and return, as the layer's region runs them
        def local(b):
            there = jax.lax.all_to_all(b, "expert", split_axis=0, concat_axis=1, tiled=True)
            return jax.lax.all_to_all(there * 1.5, "expert", split_axis=1, concat_axis=0, tiled=True)

        spec = jax.sharding.PartitionSpec(None, "expert")
        return jnp.sum(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)(buf))

    buf = moe.dispatch(x, slot, E, C)
    ws = [p["we_gate"], p["we_up"], p["we_down"]]
    grads = lambda fn: jax.jit(jax.grad(fn, argnums=(0, 1, 2, 3)))
    return {
        "routing": _timed(jax.jit(jax.grad(routing, argnums=(0, 1))), x, p["w_router"]),
        "dispatch + combine": _timed(jax.jit(jax.grad(dispatch_combine)), x),
        "expert GEMMs": _timed(grads(experts_fn), buf, *ws),
        **{f"dropless grouped, tiles of {tile} rows": _tiled(grouped, tile, x, *ws) for tile in (128, 64, 256)},
        "all_to_all dispatch + return on expert=2 (the global batch's buffers)": _timed(
            jax.jit(jax.grad(exchange)), buf
        ),
    }


def _tiled(fn, tile: int, *args) -> float:
    """`_timed` of fn(*args) with the grouped kernel's tile set to `tile` rows."""
    from meshlm.model import grouped

    saved = moe_costs.TILE
    moe_costs.TILE = grouped.TILE = tile
    try:
        return _timed(jax.jit(jax.grad(fn, argnums=(0, 1, 2, 3))), *args)
    finally:
        moe_costs.TILE = grouped.TILE = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--one-device", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    moe_cfg = config()
    active_ffn = moe_cfg.model.experts_per_token * moe_cfg.model.expert_ffn
    dense = config(n_experts=0, d_ff=active_ffn)
    assert accounting.param_count(dense.model) + moe_cfg.model.n_layers * moe_cfg.model.d_model * 8 == (
        accounting.active_param_count(moe_cfg.model)
    )  # the same active parameters, but for the router's d x E per layer
    variants = {
        "meshlm MoE 1 device": meshlm_stepper(moe_cfg),
        "meshlm MoE expert=2": meshlm_stepper(config(ParallelConfig(expert=2))),
        "meshlm MoE dropless, grouped": meshlm_stepper(config(expert_capacity_factor=0.0)),
        "meshlm MoE dropless, grouped, expert=2": meshlm_stepper(
            config(ParallelConfig(expert=2), expert_capacity_factor=0.0, moe_kernel="tiled")
        ),
        "meshlm MoE dropless, capacity buffers (C = t)": meshlm_stepper(
            config(expert_capacity_factor=0.0, moe_kernel="buffers")
        ),
        "meshlm dense, same active": meshlm_stepper(dense),
        "transformers Mixtral (PyTorch eager)": mixtral_stepper(moe_cfg),
    }
    if ONE_DEVICE:
        variants = {k: v for k, v in variants.items() if "expert=2" not in k}
    t = time_variants(variants, args.rounds, args.steps)
    tokens = BATCH * SEQ
    parts = {} if ONE_DEVICE else layer_parts(moe_cfg)
    command = " ".join(["python benchmarks/moe.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {cpu_description()}, {len(os.sched_getaffinity(0))} "
        f"CPU cores, torch {torch.__version__}, transformers {transformers.__version__}, jax {jax.__version__}; "
        f"moe-tiny shapes, vocab {VOCAB}, seq {SEQ}, batch {BATCH}, fp32, AdamW + clipping; median of "
        f"{args.rounds} alternating rounds of {args.steps} steps)",
        "",
        "| variant | tokens/s | vs meshlm MoE 1 device |",
        "|---|---:|---:|",
    ]
    base = t["meshlm MoE 1 device"]
    for name, sec in t.items():
        lines.append(f"| {name} | {tokens / sec:.0f} | {base / sec:.2f}x |")
    if ONE_DEVICE:
        lines[0] = lines[0].replace("CPU cores,", "CPU cores, one CPU device in the process,")
        publish("moe_one_device", lines, args.write)
        return
    layers = moe_cfg.model.n_layers
    lines += [
        "",
        f"One MoE layer's parts (forward + backward, jitted apart) x {layers} layers, as a share of the 1-device step:",
        "",
        "| part | ms per layer | share of the step |",
        "|---|---:|---:|",
    ]
    for name, sec in parts.items():
        lines.append(f"| {name} | {1e3 * sec:.2f} | {100 * layers * sec / base:.0f}% |")
    publish("moe", lines, args.write)


if __name__ == "__main__":
    main()
