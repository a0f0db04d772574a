"""Generation speed: `meshlm generate`'s prefill and KV-cache decode against `transformers`'
`generate` on PyTorch CPU, the same weights, side by side in one process.

For each recipe (`tiny`: 4 layers, d=128, vocab 2048; `gpt-125m`: GPT-2 small's shape, 12 layers,
d=768, vocab 50304) a randomly initialised meshlm model is exported with `meshlm.interop.hf.save_pretrained`
and loaded by `transformers.AutoModelForCausalLM` (fp32, eager, 2 intra-op threads). Both then
decode greedily from the same prompts (no end-of-text stop):

- prefill: the prompt's forward pass that fills the cache (meshlm: the jitted prefill step;
  transformers: `model(prompt, use_cache=True)`), tokens/s = batch x prompt length / time;
- decode: the per-token steps after it, tokens/s = batch x new tokens / time (transformers:
  `generate` time minus its prefill).

meshlm's compile is excluded (a warm-up call per shape first). Rounds alternate frameworks; medians.

    python benchmarks/generate_vs_hf.py [--recipes tiny,gpt-125m] [--rounds 3] [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import torch
import transformers

from _markdown import publish
from meshlm import recipes
from meshlm.config import ParallelConfig, RunConfig
from meshlm.inference import Generator, Model
from meshlm.interop import hf
from meshlm.model.params import init_params, param_specs
from meshlm.parallel.mesh import make_layout

SHAPES = {"tiny": (64, 64), "gpt-125m": (128, 128)}  # prompt tokens, new tokens


def setup(name: str, tmp: Path):
    cfg = recipes.get(name)
    model_cfg = dataclasses.replace(cfg.model, dropout=0.0, dtype="float32")
    run = RunConfig(model=model_cfg, parallel=ParallelConfig())
    layout = make_layout(run.parallel)
    params = jax.jit(lambda k: init_params(param_specs(model_cfg), k))(jax.random.key(0))
    out = hf.save_pretrained(params, model_cfg, tmp / name, log=lambda m: None)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    return Generator(Model(run, params, layout)), ref


def time_meshlm(gen: Generator, prompts: list[list[int]], new: int) -> tuple[float, float]:
    out = gen.generate(prompts, new, stop_at_eos=False)
    return out.prefill_s, out.decode_s / out.decode_steps


def time_hf(ref, prompts: list[list[int]], new: int) -> tuple[float, float]:
    ids = torch.tensor(prompts)
    with torch.no_grad():
        t0 = time.perf_counter()
        ref(ids, use_cache=True)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = ref.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        total = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new
    return prefill, (total - prefill) / (new - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default="tiny,gpt-125m")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.recipes.split(","):
            gen, ref = setup(name, Path(tmp))
            p_len, new = SHAPES[name]
            for b in map(int, args.batches.split(",")):
                rng = np.random.default_rng(b)
                prompts = rng.integers(0, 1000, (b, p_len)).tolist()
                gen.generate(prompts, new, stop_at_eos=False)  # compile (prefill and decode)
                # Same greedy tokens (first 8), so both decode the same thing.
                ours = gen.generate(prompts, 8, stop_at_eos=False).tokens
                theirs = ref.generate(torch.tensor(prompts), max_new_tokens=8, min_new_tokens=8, do_sample=False)
                assert theirs[:, p_len:].tolist() == ours, "meshlm and transformers disagree on greedy tokens"
                m, h = [], []
                for _ in range(args.rounds):
                    m.append(time_meshlm(gen, prompts, new))
                    h.append(time_hf(ref, prompts, new))
                med = lambda xs, i: statistics.median(x[i] for x in xs)
                row = {
                    "recipe": name,
                    "batch": b,
                    "prompt": p_len,
                    "new": new,
                    "m_prefill": b * p_len / med(m, 0),
                    "h_prefill": b * p_len / med(h, 0),
                    "m_decode": b / med(m, 1),
                    "h_decode": b / med(h, 1),
                }
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
    lines = [
        f"Command: `python benchmarks/generate_vs_hf.py --recipes {args.recipes} --batches {args.batches} "
        f"--rounds {args.rounds} --write` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, fp32, greedy, "
        f"jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}); "
        "medians of alternating rounds, meshlm's compile excluded.",
        "",
        "| recipe | batch | prompt | new | prefill tok/s meshlm | prefill tok/s transformers | ratio "
        "| decode tok/s meshlm | decode tok/s transformers | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['batch']} | {r['prompt']} | {r['new']} | {r['m_prefill']:,.0f} | "
            f"{r['h_prefill']:,.0f} | {r['m_prefill'] / r['h_prefill']:.2f}x | {r['m_decode']:,.1f} | "
            f"{r['h_decode']:,.1f} | {r['m_decode'] / r['h_decode']:.2f}x |"
        )
    publish("generate-vs-hf", lines, args.write)


if __name__ == "__main__":
    main()
