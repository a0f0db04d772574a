"""The blockwise kernel's tiles, folded (one loop of about nb+1 steps, nb/2 block pairs per step) vs
sequential (a loop over query blocks with a loop over key blocks inside: the context-parallel
kernel's loops, `forward_blocks`/`backward_blocks`, run on one device with positions 0..s-1), and
the default explicit kernel (query chunks of 64), side by side in one process: forward + backward of
the attention core alone, jitted, b=2, 8 query heads of 32 over 4 KV heads, fp32, block 128,
alternating rounds, medians.

    python benchmarks/attention_tiles.py [--rounds 5] [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from _markdown import write_section
from meshlm.model import layers
from meshlm.model.blockwise import backward_blocks, blockwise_attention, forward_blocks, row_delta

B, N, KV, H, BLOCK = 2, 8, 4, 32, 128


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def sequential(q, k, v, block):
    return _sequential_fwd(q, k, v, block)[0]


def _sequential_fwd(q, k, v, block):
    pos = jnp.arange(q.shape[1])
    out, lse = forward_blocks(q, k, v, None, None, pos, pos, None, block, 0.0)
    out = out.astype(q.dtype)
    return out, (q, k, v, out, lse)


def _sequential_bwd(block, res, d_out):
    q, k, v, out, lse = res
    pos = jnp.arange(q.shape[1])
    return backward_blocks(q, k, v, None, None, pos, pos, None, lse, row_delta(out, d_out), d_out, block, 0.0)


sequential.defvjp(_sequential_fwd, _sequential_bwd)

KERNELS = {
    "explicit (chunks of 64)": lambda q, k, v: layers.causal_attention(q, k, v, None, chunk=64),
    "blockwise, folded tiles": lambda q, k, v: blockwise_attention(q, k, v, block=BLOCK),
    "blockwise, sequential tiles": lambda q, k, v: sequential(q, k, v, BLOCK),
}


def timed(s: int, rounds: int) -> dict[str, float]:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, s, N, H))
    k, v = (jax.random.normal(x, (B, s, KV, H)) for x in keys[1:3])
    d = jax.random.normal(keys[3], (B, s, N, H))
    fns = {}
    for name, kernel in KERNELS.items():
        fns[name] = jax.jit(lambda q, k, v, d, kernel=kernel: jax.vjp(kernel, q, k, v)[1](d))
        jax.block_until_ready(fns[name](q, k, v, d))  # compile
    times = {name: [] for name in KERNELS}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q, k, v, d))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _sequential_tiles():
    """Patch the single-sequence kernel to run the sequential tiles while a step is traced."""
    import contextlib

    from meshlm.model import blockwise

    @contextlib.contextmanager
    def patched():
        saved = blockwise.folded_forward, blockwise.folded_backward

        def fwd(q, k, v, seg, key, block, rate):
            pos = jnp.arange(q.shape[1])
            return forward_blocks(q, k, v, seg, seg, pos, pos, key, block, rate)

        def bwd(q, k, v, seg, key, lse, delta, d_out, block, rate):
            pos = jnp.arange(q.shape[1])
            return backward_blocks(q, k, v, seg, seg, pos, pos, key, lse, delta, d_out, block, rate)

        blockwise.folded_forward, blockwise.folded_backward = fwd, bwd
        try:
            yield
        finally:
            blockwise.folded_forward, blockwise.folded_backward = saved

    return patched()


def step_rows(rounds: int, tokens: int = 4096) -> list[str]:
    """Train-step tokens/s of long_sequence.py's speed model (llama d=256, 4 layers, 8 heads, fp32, 4096
    tokens per step): explicit, blockwise with folded tiles, blockwise with sequential tiles."""
    import contextlib

    import long_sequence as ls
    from _timing import prepared_step
    from meshlm.parallel.mesh import make_layout

    rows = [
        "| s | batch | explicit tok/s | folded tok/s | sequential tok/s | folded / explicit | folded / sequential |"
    ]
    rows.append("|---:|---:|---:|---:|---:|---:|---:|")
    for s in (1024, 2048):
        variants = {}
        for name, mode, patch in (
            ("explicit", "explicit", contextlib.nullcontext),
            ("folded", "blockwise-128", contextlib.nullcontext),
            ("sequential", "blockwise-128", _sequential_tiles),
        ):
            cfg = ls.config(mode, s, 256, 4, 8, "float32", tokens // s)
            with patch():
                fn, state, batch = prepared_step(cfg, make_layout(cfg.parallel))
                state, m = fn(state, batch)  # traced and compiled under the patch
                jax.block_until_ready(m)
            variants[name] = [fn, state, batch, []]
        for _ in range(rounds):
            for entry in variants.values():
                t0 = time.perf_counter()
                entry[1], m = entry[0](entry[1], entry[2])
                jax.block_until_ready(m)
                entry[3].append(time.perf_counter() - t0)
        rate = {n: tokens / statistics.median(v[3]) for n, v in variants.items()}
        rows.append(
            f"| {s:,} | {tokens // s} | {rate['explicit']:,.0f} | {rate['folded']:,.0f} | {rate['sequential']:,.0f} | "
            f"{rate['folded'] / rate['explicit']:.2f}x | {rate['folded'] / rate['sequential']:.2f}x |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    names = list(KERNELS)
    lines = [
        f"Command: `python benchmarks/attention_tiles.py --rounds {args.rounds} --write` ({time.strftime('%Y-%m-%d')}, "
        f"{os.cpu_count()} CPU cores, jax {jax.__version__}); forward + backward of the attention core, b={B}, "
        f"{N} heads of {H} over {KV} KV heads, fp32, block {BLOCK}, median ms:",
        "",
        "| s | " + " | ".join(names) + " | folded's speed / sequential's | folded's speed / explicit's |",
        "|---:|" + "---:|" * (len(names) + 2),
    ]
    for s in (512, 1024, 2048, 4096):
        t = timed(s, args.rounds)
        folded, seq, explicit = (t[n] for n in names[1:] + names[:1])
        lines.append(
            f"| {s:,} | "
            + " | ".join(f"{1e3 * t[n]:.1f}" for n in names)
            + f" | {seq / folded:.2f}x | {explicit / folded:.2f}x |"
        )
    lines += ["", "Train steps (long_sequence.py's speed model, llama d=256, 4 layers, batch x s = 4096, median):", ""]
    lines += step_rows(args.rounds)
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("attention-tiles", text)


if __name__ == "__main__":
    main()
