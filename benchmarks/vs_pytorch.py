"""meshlm against PyTorch on this CPU: the same model and optimizer, side by side in one process.

For each family (gpt vs Hugging Face `GPT2LMHeadModel`, llama vs `LlamaForCausalLM`) and size
(small: 4 layers, d=256, 8 heads; medium: 6 layers, d=384, 6 heads; vocab 8192, seq 256, batch 8,
fp32, no dropout, AdamW with global-norm clipping) it trains:

- PyTorch eager and `torch.compile`d (`transformers` on PyTorch CPU, 2 intra-op threads);
- a minimal pure-JAX train step of the same model (plain jnp, `lax.scan` over layers, optax AdamW,
  one `jax.jit`, no meshlm code): what XLA:CPU does with this model, without the framework;
- meshlm's own train step and data path (`WindowLoader` + `process_batch` + `make_train_step`,
  what `meshlm train` runs) on one device and as data=2 over two simulated devices, each with the
  layer scan (the default) and with no layer loop (`model.scan_unroll` = layers: the layers
  chained; runs before 2026-12-01's dK/dV change had `lax.scan(unroll=n)` at data=2 only).

The process runs under meshlm's host allocator settings (`meshlm.platform.host_memory`, as `meshlm train`
on CPU), PyTorch included: `benchmarks/host_memory.py` measures both frameworks with and without.
Variants run in alternating rounds of a few steps each and report the median step time, so the
ratios within a row are comparable on a shared, noisy machine. The minimal JAX model is checked
against meshlm's forward on the same parameters before timing (same loss to 1e-5).

    python benchmarks/vs_pytorch.py [--sizes small,medium] [--families gpt,llama] [--rounds 5] [--cores N] [--write]

`--cores N` runs everything on N of the CPUs the process may use (affinity, set before JAX and
PyTorch size their thread pools; PyTorch gets N intra-op threads): with N = 1, what each framework does per
core, apart from how it uses a second one. Its table has its own section in BENCHMARKS.md.
"""

from __future__ import annotations

import math
import os
import sys
import time

import _cores  # jax-free
from meshlm.platform import host_memory  # jax-free

if __name__ == "__main__":  # pinned before JAX and PyTorch size their thread pools
    ARGS = _cores.side_by_side_args()
    _cores.pin(ARGS.cores)

# Before JAX and PyTorch start threads: the host allocator settings `meshlm train` uses on CPU
# (meshlm.platform.host_memory). PyTorch runs in this process too, so it runs under them as well.
host_memory.apply()
host_memory.keep_freed(None)

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # data=2 needs 2 devices
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import transformers

from _markdown import publish
from meshlm.accounting import causal_flops_per_step
from meshlm.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
from meshlm.data.loader import WindowLoader, process_batch
from meshlm.model.loss import cross_entropy_sum
from meshlm.model.transformer import forward
from meshlm.parallel.mesh import make_layout
from meshlm.platform.hardware import cpu_description, probe_matmul_flops
from meshlm.step import batch_sharding, make_train_step
from meshlm.train_state import init_state, setup
from meshlm.validation import validate

SIZES = {"small": (4, 256, 8), "medium": (6, 384, 6)}  # layers, d_model, heads
VOCAB, SEQ, BATCH = 8192, 256, 8
LR, B1, B2, WD, CLIP = 3e-4, 0.9, 0.95, 0.1, 1.0


def meshlm_config(family: str, size: str, data: int = 1, unroll: int = 1) -> RunConfig:
    layers, d, heads = SIZES[size]
    model = ModelConfig(
        family=family, vocab_size=VOCAB, d_model=d, n_layers=layers, n_heads=heads, max_seq_len=SEQ, scan_unroll=unroll
    )
    optim = OptimConfig(lr=LR, warmup_steps=0, b1=B1, b2=B2, weight_decay=WD, clip_norm=CLIP)
    train = TrainConfig(global_batch=BATCH, seq_len=SEQ, steps=10_000)
    return validate(RunConfig(model=model, parallel=ParallelConfig(data=data), optim=optim, train=train))


# ----------------------------------------------------------------------------- PyTorch


def torch_model(cfg: ModelConfig) -> torch.nn.Module:
    if cfg.family == "gpt":
        hf = transformers.GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.max_seq_len,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layers,
            n_head=cfg.n_heads,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(hf)
    hf = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(hf)


def torch_stepper(cfg: ModelConfig, compiled: bool):
    torch.manual_seed(0)
    model = torch_model(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2), weight_decay=WD)
    run = torch.compile(model) if compiled else model
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1))

    def step():
        out = run(input_ids=tokens[:, :-1], labels=tokens[:, :-1])  # HF shifts the labels itself
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    return step, lambda: None


# ----------------------------------------------------------------------------- minimal JAX


def _ln(x, scale, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def _rms(x, scale, eps=1e-5):
    return x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps) * scale


def _rope(x, theta):
    t, h = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None]
    ang = jnp.concatenate([ang, ang], -1)[None, :, None]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    return x * cos + jnp.concatenate([-x[..., h // 2 :], x[..., : h // 2]], -1) * sin


def _attention(q, k, v):
    b, t, n, h = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, n // kv, h)
    s = jnp.einsum("btkgh,bskh->bkgts", q, k) / math.sqrt(h)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(s, -1), v).reshape(b, t, n, h)


def minimal_loss(p, inputs, targets, cfg: ModelConfig):
    """The same model as meshlm's, written plainly: one function, no sharding, no checkpoints."""
    x = p["wte"][inputs]
    if cfg.family == "gpt":
        x = x + p["wpe"][: inputs.shape[1]][None]

    def layer(x, w):
        if cfg.family == "gpt":
            h = _ln(x, w["ln1_scale"], w["ln1_bias"])
            q = jnp.einsum("btd,dnh->btnh", h, w["wq"]) + w["bq"]
            k = jnp.einsum("btd,dnh->btnh", h, w["wk"]) + w["bk"]
            v = jnp.einsum("btd,dnh->btnh", h, w["wv"]) + w["bv"]
            x = x + jnp.einsum("btnh,nhd->btd", _attention(q, k, v), w["wo"]) + w["bo"]
            h = _ln(x, w["ln2_scale"], w["ln2_bias"])
            f = jax.nn.gelu(h @ w["w_fc"] + w["b_fc"], approximate=True)
            return x + f @ w["w_proj"] + w["b_proj"], None
        h = _rms(x, w["attn_norm"])
        q = _rope(jnp.einsum("btd,dnh->btnh", h, w["wq"]), cfg.rope_theta)
        k = _rope(jnp.einsum("btd,dnh->btnh", h, w["wk"]), cfg.rope_theta)
        v = jnp.einsum("btd,dnh->btnh", h, w["wv"])
        x = x + jnp.einsum("btnh,nhd->btd", _attention(q, k, v), w["wo"])
        h = _rms(x, w["mlp_norm"])
        return x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"], None

    x, _ = jax.lax.scan(layer, x, p["layers"])
    if cfg.family == "gpt":
        logits = _ln(x, p["ln_f_scale"], p["ln_f_bias"]) @ p["wte"].T
    else:
        logits = _rms(x, p["final_norm"]) @ p["lm_head"]
    picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def minimal_stepper(run: RunConfig, params):
    cfg = run.model
    decay = jax.tree.map(lambda x: x.ndim >= 2, params)
    tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, B1, B2, weight_decay=WD, mask=decay))
    dev = jax.devices()[0]
    state = jax.device_put((params, tx.init(params)), dev)

    @jax.jit
    def step(state, inputs, targets):
        p, o = state
        loss, g = jax.value_and_grad(minimal_loss)(p, inputs, targets, cfg)
        updates, o = tx.update(g, o, p)
        return (optax.apply_updates(p, updates), o), loss

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)
    box = {"state": state}

    def one():
        box["state"], loss = step(box["state"], tokens[:, :-1], tokens[:, 1:])
        return loss

    return one, lambda: jax.block_until_ready(box["state"])


# ----------------------------------------------------------------------------- meshlm


def meshlm_stepper(run: RunConfig):
    layout = make_layout(run.parallel, jax.devices()[: run.parallel.n_devices])
    specs, tx, shardings = setup(run, layout)
    state = init_state(specs, layout, tx, run.train.seed)
    step = make_train_step(run, layout, tx, shardings)
    tokens = np.random.default_rng(0).integers(0, run.model.vocab_size, 200 * BATCH * (SEQ + 1)).astype(np.int32)
    loader = WindowLoader(tokens, SEQ, BATCH, seed=0)
    sharding = batch_sharding(layout)
    box = {"state": state, "n": 0}

    def one():
        box["state"], metrics = step(box["state"], process_batch(loader, box["n"], sharding))
        box["n"] += 1
        return metrics["loss"]

    return one, lambda: jax.block_until_ready(box["state"])


def check_minimal_model(run: RunConfig) -> dict:
    """meshlm's parameters, and proof that the minimal model computes meshlm's loss with them."""
    specs, _, _ = setup(run, make_layout(run.parallel, jax.devices()[:1]))
    from meshlm.model.params import init_params

    params = jax.device_get(init_params(specs, jax.random.key(0)))
    tokens = np.random.default_rng(1).integers(0, run.model.vocab_size, (2, SEQ + 1)).astype(np.int32)
    total, count = cross_entropy_sum(forward(params, tokens[:, :-1], run.model), tokens[:, 1:])
    ours = float(total / count)
    theirs = float(minimal_loss(params, tokens[:, :-1], tokens[:, 1:], run.model))
    assert abs(ours - theirs) < 1e-5 * abs(ours), (ours, theirs)
    return params


def time_patched_steps(run: RunConfig, patches: dict, restore, rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of meshlm's step for `run`, traced and compiled once under each
    variant's code paths (`patches`: name -> a callable that installs them), timed side by side;
    `restore()` puts the real code paths back before timing."""
    steppers = {}
    for name, install in patches.items():
        install()
        one, sync = meshlm_stepper(run)
        one()  # trace and compile under this variant's code paths
        sync()
        steppers[name] = (one, sync)
    restore()
    return time_variants(steppers, rounds, steps)


def time_variants(variants: dict, rounds: int, steps: int) -> dict[str, float]:
    for one, sync in variants.values():  # compile / warm up
        for _ in range(2):
            one()
        sync()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (one, sync) in variants.items():
            t = time.perf_counter()
            for _ in range(steps):
                one()
            sync()
            times[name].append((time.perf_counter() - t) / steps)
    return {name: float(np.median(v)) for name, v in times.items()}


def main() -> None:
    args = ARGS
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    command = " ".join(["python benchmarks/vs_pytorch.py", *sys.argv[1:]])
    peak = probe_matmul_flops("float32")  # this host's matmul peak, measured in this run
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {cpu_description()}, {cores} of {os.cpu_count()} "
        f"CPU cores, torch {torch.__version__}, transformers {transformers.__version__}, jax {jax.__version__}; "
        f"vocab {VOCAB}, seq {SEQ}, batch {BATCH}, "
        f"fp32, AdamW + clipping; median of {args.rounds} alternating rounds of {args.steps} steps; tokens/s; "
        f"MFU = causal model FLOPs (P2 Eq. 7 without the masked half of attention, as `meshlm train` logs) "
        f"/ step time / this host's fp32 1024^3 matmul probe, {peak / 1e9:.0f} GFLOP/s)",
        "",
        "| family | size | PyTorch eager | PyTorch compiled | minimal JAX | meshlm 1 device | meshlm 1 device chained "
        "| meshlm data=2 | meshlm data=2 chained | meshlm best / PyTorch best | MFU meshlm best | MFU PyTorch best |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    tokens = BATCH * SEQ
    for family in args.families.split(","):
        for size in args.sizes.split(","):
            run = meshlm_config(family, size)
            params = check_minimal_model(run)
            variants = {
                "torch eager": torch_stepper(run.model, compiled=False),
                "torch compiled": torch_stepper(run.model, compiled=True),
                "minimal JAX": minimal_stepper(run, params),
                "meshlm 1": meshlm_stepper(run),
                "meshlm 1 chained": meshlm_stepper(meshlm_config(family, size, 1, SIZES[size][0])),
                "meshlm data=2": meshlm_stepper(meshlm_config(family, size, data=2)),
                "meshlm data=2 chained": meshlm_stepper(meshlm_config(family, size, 2, SIZES[size][0])),
            }
            t = time_variants(variants, args.rounds, args.steps)
            rate = {k: tokens / v for k, v in t.items()}
            best_torch = max(rate["torch eager"], rate["torch compiled"])
            best_meshlm = max(v for k, v in rate.items() if k.startswith("meshlm"))
            cells = " | ".join(f"{rate[k]:.0f}" for k in variants)
            mfu_per_token_s = causal_flops_per_step(run) / tokens / peak  # MFU of 1 token/s
            lines.append(
                f"| {family} | {size} | {cells} | {best_meshlm / best_torch:.2f}x "
                f"| {100 * mfu_per_token_s * best_meshlm:.0f}% | {100 * mfu_per_token_s * best_torch:.0f}% |"
            )
            print(lines[-1], flush=True)
    publish("vs_pytorch" if cores == os.cpu_count() else f"vs_pytorch_{cores}core", lines, args.write)


if __name__ == "__main__":
    main()
