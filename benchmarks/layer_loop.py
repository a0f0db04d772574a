"""Where the backward loses to PyTorch: one layer, the head and the layer loop, each timed alone
(forward + backward, in alternating rounds in one process), on the models of
`benchmarks/vs_pytorch.py` (one device, no dropout).

- one layer: meshlm's `BLOCKS[family]` on layer 0's weights against Hugging Face's first decoder
  layer, the gradient of a fixed random cotangent;
- the head: final norm, output layer and mean cross-entropy, meshlm's `logits` +
  `cross_entropy_sum` against the model's norm, `lm_head` and `cross_entropy`;
- all layers: meshlm's `run_layers` (the `lax.scan` the model runs), the same scan fully unrolled
  (`lax.scan(unroll=n)`), and the layers chained as plain calls on the stacked weights split
  along the layer axis, no loop (`run_layers(chain=True)`, what `model.scan_unroll` = layers runs).

    python benchmarks/layer_loop.py [--sizes medium] [--families gpt] [--rounds 5] [--write]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import vs_pytorch as vs  # first: meshlm's host allocator settings and JAX_PLATFORMS=cpu, before JAX loads

# isort: split
import jax
import jax.numpy as jnp
import numpy as np
import torch

from _markdown import publish
from meshlm.model import transformer
from meshlm.model.loss import cross_entropy_sum
from meshlm.model.params import init_params
from meshlm.parallel.mesh import make_layout
from meshlm.train_state import setup


def variants(family: str, size: str) -> dict:
    run = vs.meshlm_config(family, size)
    cfg = run.model
    specs, _, _ = setup(run, make_layout(run.parallel, jax.devices()[:1]))
    params = init_params(specs, jax.random.key(0))
    stacked, top = params["layers"], {k: v for k, v in params.items() if k != "layers"}
    rng = np.random.default_rng(0)
    x, g = (jnp.asarray(rng.standard_normal((vs.BATCH, vs.SEQ, cfg.d_model)).astype(np.float32)) for _ in range(2))
    targets = jnp.asarray(rng.integers(0, cfg.vocab_size, (vs.BATCH, vs.SEQ)).astype(np.int32))
    block = partial(transformer.BLOCKS[family], cfg=cfg, layout=None, remat_policy="elementwise")
    ids = jnp.arange(cfg.n_layers)

    def layer_slice(i):
        return jax.tree.map(lambda a: a[i], stacked)

    def unrolled(x, st):  # the scan with every layer in one iteration
        return jax.lax.scan(lambda x, p: (block(x, p, None), None), x, st, unroll=cfg.n_layers)[0]

    loops = {
        "scan": lambda x, st: transformer.run_layers(x, st, ids, cfg),
        "unrolled": unrolled,
        "chained": lambda x, st: transformer.run_layers(x, st, ids, cfg, chain=True),  # the no-loop path
    }

    def grad_of(f, *args):
        fn = jax.jit(lambda g, *a: jax.vjp(f, *a)[1](g))
        return lambda: jax.block_until_ready(fn(g, *args))

    def head_loss(top, x):
        total, count = cross_entropy_sum(transformer.logits(top, x, cfg), targets)
        return total / count

    head = jax.jit(jax.grad(head_loss, argnums=(0, 1)))
    out = {
        ("meshlm", "layer"): grad_of(lambda x, p: block(x, p, None), x, layer_slice(0)),
        ("meshlm", "head"): lambda: jax.block_until_ready(head(top, x)),
    } | {("meshlm", name): grad_of(f, x, stacked) for name, f in loops.items()}

    torch.manual_seed(0)
    model = vs.torch_model(cfg)
    model.train()
    tx, tg = torch.tensor(np.asarray(x), requires_grad=True), torch.tensor(np.asarray(g))
    tt = torch.tensor(np.asarray(targets)).long()
    if family == "gpt":
        t_layer, norm = model.transformer.h[0], model.transformer.ln_f
        call = lambda: t_layer(tx)
    else:
        t_layer, norm = model.model.layers[0], model.model.norm
        rope = model.model.rotary_emb(tx, torch.arange(vs.SEQ)[None])
        call = lambda: t_layer(tx, position_embeddings=rope, attention_mask=None)

    def torch_layer():
        y = call()
        (y[0] if isinstance(y, tuple) else y).backward(tg)
        model.zero_grad(set_to_none=True)
        tx.grad = None

    def torch_head():
        logits = model.lm_head(norm(tx))
        torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab_size), tt.view(-1)).backward()
        model.zero_grad(set_to_none=True)
        tx.grad = None

    out |= {("torch", "layer"): torch_layer, ("torch", "head"): torch_head}
    return {k: (f, lambda: None) for k, f in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="medium")
    ap.add_argument("--families", default="gpt")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="calls per timed round")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    command = " ".join(["python benchmarks/layer_loop.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, 2 CPU cores, torch {torch.__version__} eager, "
        f"jax {jax.__version__}, 1 device; batch {vs.BATCH}, seq {vs.SEQ}, fp32; forward + backward, median ms of "
        f"{args.rounds} alternating rounds of {args.steps} calls)",
        "",
        "| family | size | one layer: meshlm / PyTorch | head: meshlm / PyTorch | all layers: scan | unrolled "
        "| chained | scan / chained |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for family in args.families.split(","):
        for size in args.sizes.split(","):
            ms = {k: t * 1e3 for k, t in vs.time_variants(variants(family, size), args.rounds, args.steps).items()}
            m = {name: t for (fw, name), t in ms.items() if fw == "meshlm"}
            lines.append(
                f"| {family} | {size} | {m['layer']:.0f} / {ms[('torch', 'layer')]:.0f} "
                f"| {m['head']:.0f} / {ms[('torch', 'head')]:.0f} | {m['scan']:.0f} | {m['unrolled']:.0f} "
                f"| {m['chained']:.0f} | {m['scan'] / m['chained']:.2f}x |"
            )
            print(lines[-1], flush=True)
    publish("layer_loop", lines, args.write)


if __name__ == "__main__":
    main()
