"""meshlm on a TPU chip: the Pallas kernels checked on the device against a CPU reference, the rates
the planner assumes measured, and training steps timed beside the planner's prediction.

Sections (each runs on, a failure is reported and the next one starts):

- `matmul`: a bf16 8192^3 product, TFLOP/s (the chip's dense rate as this JAX reaches it);
- `kernels`: splash attention (`model.attention=fused` on TPU), outputs and gradients against
  explicit attention on the host CPU in fp32 (GQA, documents, s not a multiple of 128, a causal
  offset as all_gather runs it); a model's loss and raw gradients with fused vs explicit attention
  (llama with GQA, and deepseek-tiny's MLA, whose value heads are padded to the query-key size);
  moe-tiny's raw gradients, dropless, with megablox `gmm` and `ragged_dot` on the chip against the
  tiled kernel on the host CPU; `ragged_all_to_all` on a one-device mesh (XLA:CPU refuses it);
- `attention`: forward + backward of each attention kernel at two model shapes, as a fraction of
  the chip's dense peak with the FLOPs the planner counts (`accounting.attention_core_flops`), so
  `insight/attention_rates.py` can cite a measurement;
- `grouped`: one MoE layer's expert SwiGLU (Qwen3-30B-A3B's widths: d=2048, f=768, 128 experts, top-8)
  forward + backward with megablox and ragged_dot, beside capacity-free dense GEMMs of the same
  routed FLOPs (the planner's grouped-GEMM rate);
- `steps`: train steps of recipes at the planner's best layout for one chip: tokens/s, MFU, the
  step program's peak memory beside the planner's predicted step time and memory;
- `memory`: gpt-125m's train step compiled (nothing run) for layouts of one chip, the program's peak
  (XLA's buffer assignment) beside the planner's memory (states, stored activations, the loss's
  transients) and its logits, the loss whole and in token chunks (`remat.loss_chunks`);
- `loss`: gpt-125m's train step timed with the loss whole and in 4 and 16 chunks.

    benchmarks/tpu.sh [--sections kernels attention ...]   # on a TPU machine, under 10 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

RESULTS: dict = {}
SMOKE = "--smoke" in sys.argv  # small shapes, Pallas in interpret mode: the script's own check off a TPU
INTERPRET = SMOKE


def timed(fn, *args, reps: int = 10) -> float:
    """Median seconds of fn(*args) after one warm call (compile)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_err(got, want) -> float:
    """max |got - want| / max |want| over the leaves (the largest leaf's figure)."""
    errs = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        errs.append(float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)))
    return max(errs)


def leaf_errs(got: dict, want: dict) -> dict[str, float]:
    """Per-leaf relative error (norm of the difference over the norm of the reference)."""
    from meshlm.model.params import named_leaves

    w = named_leaves(want)
    out = {}
    for name, g in named_leaves(got).items():
        g64, w64 = np.asarray(g, np.float64), np.asarray(w[name], np.float64)
        out[name] = float(np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 1e-30))
    return out


def _accelerator():
    from meshlm.platform import hardware

    kind = jax.devices()[0].device_kind
    return hardware.ACCELERATORS["tpu-v5e"] if SMOKE else hardware.BY_DEVICE_KIND[kind]


def section_matmul() -> dict:
    size = 1024 if SMOKE else 8192
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    s = timed(jax.jit(lambda a: a @ a), a)
    return {"tflops": 2 * size**3 / s / 1e12}


def _qkv(b, t, n, kv, h, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(b, t, n, h), (b, t, kv, h), (b, t, kv, h), (b, t, n, h)]
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(ks, shapes, strict=True)]


def _vjp(fn, q, k, v, d):
    out, pull = jax.vjp(fn, q, k, v)
    return out, pull(d)


def section_kernels() -> dict:
    from meshlm.model import kernels, layers

    cpu = jax.devices("cpu")[0]
    res = {}
    b, t, n, kv, h = (1, 200, 4, 2, 128) if SMOKE else (2, 1000, 8, 2, 128)  # GQA; t not a multiple of 128
    q, k, v, d = _qkv(b, t, n, kv, h, seed=1)
    seg = jnp.asarray(np.cumsum(np.random.default_rng(0).random((b, t)) < 0.004, axis=1), jnp.int32)
    for docs in (False, True):
        s_ = seg if docs else None
        with jax.default_device(cpu):
            ref = _vjp(partial(layers.causal_attention, segment_ids_bt=s_), *jax.device_put((q, k, v, d), cpu))
        for dtype in ("float32", "bfloat16"):
            args = [x.astype(dtype) for x in (q, k, v, d)]
            got = jax.jit(partial(_vjp, partial(kernels.splash_attention, segment_ids_bt=s_, interpret=INTERPRET)))(
                *args
            )
            res[f"splash {dtype} docs={docs}: out, grads rel err"] = [rel_err(got[0], ref[0]), rel_err(got[1], ref[1])]
    # all_gather's kernel: the second half of the queries at offset t/2 against every key
    t2, off = (256, 128) if SMOKE else (1024, 512)
    q, k, v, d = _qkv(b, t2, n, kv, h, seed=2)
    with jax.default_device(cpu):
        whole = lambda qc, k, v: layers.causal_attention(q.at[:, off:].set(qc), k, v)[:, off:]
        ref = _vjp(whole, *jax.device_put((q[:, off:], k, v, d[:, off:]), cpu))
    at = partial(kernels.splash_attention_at, seg_q_bt=None, seg_k_bs=None, offset=off, interpret=INTERPRET)
    got = jax.jit(partial(_vjp, at))(q[:, off:], k, v, d[:, off:])
    res[f"splash_at offset {off} fp32: out, grads rel err"] = [rel_err(got[0], ref[0]), rel_err(got[1], ref[1])]
    for check in (_model_checks, _moe_checks):
        try:
            res |= check(cpu)
        except Exception as e:
            res[check.__name__] = f"FAILED: {type(e).__name__}: {str(e)[-600:]}"
    res["ragged_all_to_all"] = _ragged_all_to_all()
    return res


def _grads_on(cfg, params, device, batch):
    import optax

    from meshlm.model.params import param_specs
    from meshlm.parallel.mesh import make_layout
    from meshlm.step import make_grad_step
    from meshlm.train_state import state_shardings

    layout = make_layout(cfg.parallel, [device])
    shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
    return jax.device_get(make_grad_step(cfg, layout, shardings)(jax.device_put(params, shardings), batch, 5))


def _small(cfg, batch=4, seq=256, **model):
    from meshlm.validation import validate

    tr = dataclasses.replace(cfg.train, global_batch=batch, seq_len=seq, microbatches=1)
    m = dataclasses.replace(cfg.model, max_seq_len=max(seq, cfg.model.max_seq_len), **model)
    from meshlm.config import ParallelConfig

    return validate(dataclasses.replace(cfg, model=m, train=tr, parallel=ParallelConfig()))


def _batch(cfg, seed=3):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len + 1)).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


def _model_checks(cpu) -> dict:
    """Loss and raw gradients, fused (splash) on the chip vs explicit on the host CPU, fp32."""
    from meshlm import recipes
    from meshlm.model.params import init_params, param_specs

    out = {}
    llama = _small(recipes.get("llama-tiny"), d_model=512, n_heads=4, n_kv_heads=2, dtype="float32")
    ds = _small(recipes.get("deepseek-tiny"), dtype="float32")
    for name, cfg in (("llama d=512 h=128 GQA", llama), ("deepseek-tiny MLA", ds)):
        params = jax.device_get(init_params(param_specs(cfg.model), jax.random.key(0)))
        batch = _batch(cfg)
        fused = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="fused"))
        # the host's MoE layers on the tiled kernel: `moe_kernel=auto` asks jax.default_backend(), the chip's
        cpu_moe = {"moe_kernel": "tiled"} if cfg.model.n_experts else {}
        explicit = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="explicit", **cpu_moe))
        with jax.default_matmul_precision("highest"):
            got = _grads_on(fused, params, jax.devices()[0], batch)
        with jax.default_device(cpu):
            want = _grads_on(explicit, params, cpu, batch)
        errs = leaf_errs(got["grads"], want["grads"])
        worst = max(errs, key=errs.get)
        out[f"{name}: fused on chip vs explicit on CPU"] = {
            "loss": [float(got["loss"]), float(want["loss"])],
            "worst grad leaf": [worst, errs[worst]],
        }
    return out


def _moe_checks(cpu) -> dict:
    """moe-tiny's raw gradients, dropless: megablox and ragged_dot on the chip vs tiled on the CPU."""
    from meshlm import recipes
    from meshlm.model.params import init_params, param_specs

    out = {}
    base = _small(
        recipes.get("moe-tiny"), batch=4, seq=128, dtype="float32", expert_capacity_factor=0.0, attention="explicit"
    )
    params = jax.device_get(init_params(param_specs(base.model), jax.random.key(1)))
    batch = _batch(base)
    with jax.default_device(cpu):
        want = _grads_on(_small(base, batch=4, seq=128, moe_kernel="tiled"), params, cpu, batch)
    for kernel in ("megablox", "ragged_dot"):
        try:
            with jax.default_matmul_precision("highest"):
                got = _grads_on(_small(base, batch=4, seq=128, moe_kernel=kernel), params, jax.devices()[0], batch)
            errs = leaf_errs(got["grads"], want["grads"])
            worst = max(errs, key=errs.get)
            out[f"moe-tiny dropless {kernel} on chip vs tiled on CPU"] = {
                "loss": [float(got["loss"]), float(want["loss"])],
                "worst grad leaf": [worst, errs[worst]],
            }
        except Exception as e:
            out[f"moe-tiny dropless {kernel}"] = f"FAILED: {type(e).__name__}: {str(e)[:400]}"
    return out


def _ragged_all_to_all() -> str:
    """jax.lax.ragged_all_to_all on a one-device mesh: 3 rows of 5 sent to itself at offset 1."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    x = jnp.arange(5, dtype=jnp.float32).reshape(5, 1) + 1

    def f(x):
        out = jnp.zeros((6, 1), jnp.float32)
        one = lambda v: jnp.array([v], jnp.int32)
        return jax.lax.ragged_all_to_all(x, out, one(0), one(3), one(1), one(3), axis_name="x")

    try:
        y = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P()))(x)
        want = np.array([0, 1, 2, 3, 0, 0], np.float32)
        got = np.asarray(y).ravel()
        return f"ran: {got.tolist()} ({'as expected' if np.allclose(got, want) else 'WRONG'})"
    except Exception as e:
        return f"FAILED: {type(e).__name__}: {str(e)[:300]}"


def section_attention() -> dict:
    """Each kernel's forward + backward, bf16, as a fraction of the chip's dense peak."""
    from meshlm import accounting, recipes
    from meshlm.model import kernels, layers
    from meshlm.model.blockwise import blockwise_attention

    acc = _accelerator()
    out = {}
    shapes = ((1, 256, 2, 2, 64),) if SMOKE else ((8, 2048, 12, 12, 64), (4, 4096, 16, 8, 128))
    for b, s, n, kv, h in shapes:
        q, k, v, d = _qkv(b, s, n, kv, h, seed=4, dtype=jnp.bfloat16)
        fns = {"explicit": lambda q, k, v: layers.causal_attention(q, k, v)}
        for blk in (128, 512) if SMOKE else (128, 256, 512, 1024):
            fns[f"blockwise block={blk}"] = partial(
                lambda q, k, v, blk: blockwise_attention(q, k, v, block=blk), blk=blk
            )
            fns[f"splash block={blk}"] = partial(
                lambda q, k, v, blk: kernels.splash_attention(q, k, v, block=blk, interpret=INTERPRET), blk=blk
            )
        for name, fn in fns.items():
            base = recipes.get("gpt-125m")
            m = dataclasses.replace(
                base.model,
                d_model=n * h,
                n_heads=n,
                n_kv_heads=kv,
                n_layers=1,
                max_seq_len=s,
                attention="explicit" if name == "explicit" else "blockwise",
            )
            tr = dataclasses.replace(base.train, global_batch=b, seq_len=s, microbatches=1)
            cfg = dataclasses.replace(
                base, model=m, train=tr, remat=dataclasses.replace(base.remat, policy="elementwise")
            )
            flops = accounting.attention_core_flops(cfg)
            try:
                sec = timed(jax.jit(partial(_vjp, fn)), q, k, v, d)
                out[f"{name} b={b} s={s} n={n} kv={kv} h={h}"] = {
                    "ms": sec * 1e3,
                    "fraction of peak": flops / sec / acc.peak["bf16"],
                }
            except Exception as e:
                out[f"{name} b={b} s={s} n={n} kv={kv} h={h}"] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
    return out


def section_grouped() -> dict:
    """Qwen3-30B-A3B's expert layer on 8192 tokens: grouped GEMMs vs dense GEMMs of the routed FLOPs."""
    from meshlm.model import grouped, moe_costs
    from meshlm.model.layers import swiglu

    tokens, k, E, dm, f = (256, 2, 8, 128, 128) if SMOKE else (8192, 8, 128, 2048, 768)
    n = tokens * k
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, E, n), jnp.int32)
    keys = jax.random.split(jax.random.key(0), 4)
    ws = [
        jax.random.normal(keys[i], s, jnp.bfloat16) * 0.02 for i, s in enumerate([(E, dm, f), (E, dm, f), (E, f, dm)])
    ]
    x = jax.random.normal(keys[3], (tokens, dm), jnp.bfloat16)
    source = jnp.arange(n, dtype=jnp.int32) // k
    routed = 6 * n * dm * f * 3  # forward + backward, three GEMMs
    out = {}
    for kernel in ("megablox", "ragged_dot"):

        def loss(x, *ws, kernel=kernel):
            g = grouped.Groups(ids, E, moe_costs.grouped_rows(n, E))
            y = grouped.expert_swiglu(g.gather(x, source), g, *ws, swiglu, kernel, INTERPRET)
            return jnp.sum(g.scatter(y).astype(jnp.float32))

        try:
            sec = timed(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), x, *ws)
            out[kernel] = {"ms": sec * 1e3, "routed TFLOP/s": routed / sec / 1e12}
        except Exception as e:
            out[kernel] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
    # dense: the same rows as one GEMM chain per expert-sized block (E equal groups, batched)
    xe = jax.random.normal(keys[3], (E, n // E, dm), jnp.bfloat16)

    def dense(xe, w_gate, w_up, w_down):
        gate = jnp.einsum("erd,edf->erf", xe, w_gate)
        up = jnp.einsum("erd,edf->erf", xe, w_up)
        return jnp.sum(jnp.einsum("erf,efd->erd", swiglu(gate, up), w_down).astype(jnp.float32))

    sec = timed(jax.jit(jax.grad(dense, argnums=(0, 1, 2, 3))), xe, *ws)
    out["batched dense GEMMs (equal groups)"] = {"ms": sec * 1e3, "routed TFLOP/s": routed / sec / 1e12}
    return out


def section_steps(recipes_: list[str], steps: int) -> dict:
    from meshlm import accounting, recipes
    from meshlm.insight import plan as planner

    sys.path.insert(0, os.path.dirname(__file__))
    from _timing import timed_steps

    acc = _accelerator()
    out = {}
    for name in recipes_:
        cfg = recipes.get(name)
        feasible = [p for p in planner.enumerate_plans(cfg, 1, acc) if not p.rejected]
        if not feasible:
            out[name] = "no plan fits one chip"
            continue
        best = feasible[0].cfg
        for attention in dict.fromkeys([best.model.attention, "fused"]):
            c = dataclasses.replace(best, model=dataclasses.replace(best.model, attention=attention))
            plan = planner.estimate(c, acc)
            key = f"{name} {planner.Plan(c).describe()} attention={attention}"
            try:
                compiled, m, step_s, compile_s = timed_steps(c, steps)
                # peak_bytes_in_use counts arrays live between programs (the state), not a program's
                # temporaries, where the activations are: 1.44 GiB for a step whose program peaks at 11.7
                stats, analysis = jax.devices()[0].memory_stats() or {}, compiled.memory_analysis()
                out[key] = {
                    "step s": step_s,
                    "predicted step s": plan.step_time,
                    "tokens/s": c.train.global_batch * c.train.seq_len / step_s,
                    "MFU": accounting.causal_flops_per_step(c) / step_s / acc.peak["bf16"],
                    "predicted MFU": plan.mfu,
                    "program peak GiB": getattr(analysis, "peak_memory_in_bytes", 0) / 2**30,
                    "process's reserved peak so far GiB": stats.get("peak_bytes_reserved", 0) / 2**30,
                    "predicted GiB": plan.total_memory / 2**30,
                    "compile s": compile_s,
                    "loss": float(m["loss"]),
                }
                del compiled  # the next variant's program must not sit beside this one's
            except Exception as e:
                out[key] = f"FAILED: {type(e).__name__}: {str(e)[:400]}"
            print(key, out[key], flush=True)
    return out


# (attention, remat policy, microbatches, vocabulary or 0: the recipe's, dropout or None, loss chunks)
MEMORY_LAYOUTS = [
    ("explicit", "elementwise", 128, 0, None, 1),
    ("explicit", "elementwise", 128, 0, None, 4),
    ("blockwise", "elementwise", 32, 0, None, 1),
    ("blockwise", "elementwise", 32, 0, None, 16),
    ("blockwise", "full", 8, 0, None, 1),  # asked whole: the planner chunks it (64), as the logits do not fit
    ("fused", "elementwise", 32, 0, 0.0, 1),
    ("fused", "elementwise", 32, 0, 0.0, 16),
    ("fused", "elementwise", 8, 0, 0.0, 64),
    # the layer-level policies' rerun layer (`step_peak.recomputed_layer_bytes`)
    ("blockwise", "full", 32, 0, None, 16),
    ("explicit", "full", 128, 0, None, 4),
    ("blockwise", "dots", 32, 0, None, 16),
    ("explicit", "dots", 128, 0, None, 4),
    ("blockwise", "offload", 32, 0, None, 16),
]  # ("explicit", "selective", 32): XLA:TPU's compiler died of a stack overflow (SIGSEGV), 2026-12-07


def section_memory() -> dict:
    from meshlm import accounting, recipes
    from meshlm.config import ParallelConfig, RematConfig
    from meshlm.insight import plan as planner
    from meshlm.insight.step_peak import transient_terms
    from meshlm.parallel.mesh import make_layout
    from meshlm.step import make_train_step
    from meshlm.train_state import init_state, setup
    from meshlm.validation import validate

    base, GiB, out = recipes.get("gpt-125m"), 2**30, {}
    for attention, policy, micro, vocab, dropout, chunks in MEMORY_LAYOUTS:
        m = dataclasses.replace(base.model, attention=attention, vocab_size=vocab or base.model.vocab_size)
        m = m if dropout is None else dataclasses.replace(m, dropout=dropout)
        if SMOKE:
            m = dataclasses.replace(m, n_layers=2, d_model=128, n_heads=2, vocab_size=1024)
        train = dataclasses.replace(base.train, microbatches=micro)
        remat = RematConfig(policy, loss_chunks=chunks)
        c = validate(dataclasses.replace(base, model=m, parallel=ParallelConfig(), remat=remat, train=train))
        plan = planner.estimate(c, _accelerator())
        c = plan.cfg  # the planner's loss chunks where the whole logits do not fit
        key = f"{attention} {policy} micro={micro} vocab={m.vocab_size} dropout={m.dropout} "
        key += f"loss_chunks={c.remat.loss_chunks}" + (f" (asked {chunks})" if chunks != c.remat.loss_chunks else "")
        rec = {"planner GiB": plan.total_memory / GiB, "rejected": plan.rejected, "loss chunks": c.remat.loss_chunks}
        outside = accounting.activation_memory(c)["outside"]
        rec["planner's logits GiB"] = outside.get("logits", 0.0) / GiB
        terms = transient_terms(c)
        rec["planner's recomputed layer GiB"] = terms.pop("recomputed layer", 0.0) / GiB
        rec["planner's loss transients GiB"] = sum(terms.values()) / GiB
        try:
            layout = make_layout(c.parallel)
            specs, tx, shardings = setup(c, layout)
            state = jax.eval_shape(lambda specs=specs, layout=layout, tx=tx: init_state(specs, layout, tx, 0))
            batch = {
                k: jax.ShapeDtypeStruct((c.train.global_batch, c.train.seq_len), jnp.int32)
                for k in ("inputs", "targets")
            }
            analysis = make_train_step(c, layout, tx, shardings).lower(state, batch).compile().memory_analysis()
            rec["program peak GiB"] = analysis.peak_memory_in_bytes / GiB
            rec["peak / planner"] = analysis.peak_memory_in_bytes / plan.total_memory
        except Exception as e:  # a layout that does not fit: XLA says by how much
            rec["program"] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
        out[key] = rec
        print(key, rec, flush=True)
    return out


def section_diagnose() -> dict:
    """gpt-125m's layer shapes at 4 microbatches of 8 x 2048 (the planned layout's microbatch): the
    step time by attention kernel, block and dropout, and a profile of two of them (the ops that
    take the device's time, from the trace)."""
    from meshlm import recipes
    from meshlm.config import ParallelConfig
    from meshlm.parallel.mesh import make_layout

    sys.path.insert(0, os.path.dirname(__file__))
    from _timing import prepared_step

    base = recipes.get("gpt-125m")
    if SMOKE:
        base = dataclasses.replace(base, model=dataclasses.replace(base.model, n_layers=2, d_model=128, n_heads=2))
    tr = dataclasses.replace(
        base.train, global_batch=8 if SMOKE else 32, seq_len=256 if SMOKE else 2048, microbatches=4
    )
    base = dataclasses.replace(base, train=tr, parallel=ParallelConfig())
    variants = {
        "blockwise 128, dropout 0.1 (planned)": dict(attention="blockwise"),
        "blockwise 128, dropout 0": dict(attention="blockwise", dropout=0.0),
        "explicit, dropout 0.1": dict(attention="explicit"),
        "explicit, dropout 0": dict(attention="explicit", dropout=0.0),
        "splash 128, dropout 0": dict(attention="fused", dropout=0.0),
        "splash 512, dropout 0": dict(attention="fused", dropout=0.0, attention_block=512),
        "blockwise 512, dropout 0": dict(attention="blockwise", dropout=0.0, attention_block=512),
    }
    out = {}
    for name, model in variants.items():
        c = dataclasses.replace(base, model=dataclasses.replace(base.model, **model))
        try:
            fn, state, batch = prepared_step(c, make_layout(c.parallel, jax.devices()[:1]))
            state, m = fn(state, batch)
            jax.block_until_ready(m)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                state, m = fn(state, batch)
                jax.block_until_ready(m)
                times.append(time.perf_counter() - t0)
            out[name] = {"step s": statistics.median(times), "loss": float(m["loss"])}
            if name in ("blockwise 128, dropout 0.1 (planned)", "splash 512, dropout 0"):
                out[name]["top ops"] = _profile(fn, state, batch, name)
        except Exception as e:
            out[name] = f"FAILED: {type(e).__name__}: {str(e)[:400]}"
        print(
            name,
            {k: v for k, v in out[name].items() if k != "top ops"} if isinstance(out[name], dict) else out[name],
            flush=True,
        )
    return out


def section_dropout() -> dict:
    """gpt-125m's shapes (4 microbatches of 8 x 2048), fused attention: the step with P2's dropout 0.1
    (JAX's default threefry bits, and the "rbg" implementation) and without dropout."""
    from meshlm import recipes
    from meshlm.config import ParallelConfig
    from meshlm.parallel.mesh import make_layout

    sys.path.insert(0, os.path.dirname(__file__))
    from _timing import prepared_step

    base = recipes.get("gpt-125m")
    tr = dataclasses.replace(base.train, global_batch=32, seq_len=2048, microbatches=4)
    base = dataclasses.replace(base, train=tr, parallel=ParallelConfig())
    out = {}
    for name, rate, impl in (
        ("dropout 0.1, threefry", 0.1, "threefry2x32"),
        ("dropout 0.1, rbg", 0.1, "rbg"),
        ("dropout 0", 0.0, "threefry2x32"),
    ):
        c = dataclasses.replace(base, model=dataclasses.replace(base.model, attention="fused", dropout=rate))
        jax.config.update("jax_default_prng_impl", impl)
        try:
            fn, state, batch = prepared_step(c, make_layout(c.parallel, jax.devices()[:1]))
            state, m = fn(state, batch)  # the step donates its state: each call takes the last one's
            jax.block_until_ready(m)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                state, m = fn(state, batch)
                jax.block_until_ready(m)
                times.append(time.perf_counter() - t0)
            out[name] = {"step s": statistics.median(times), "loss": float(m["loss"])}
        except Exception as e:
            out[name] = f"FAILED: {type(e).__name__}: {str(e)[:400]}"
        finally:
            jax.config.update("jax_default_prng_impl", "threefry2x32")
        print(name, out[name], flush=True)
    return out


def _profile(fn, state, batch, name: str, top: int = 25) -> list:
    """One step under jax.profiler: the device ops' total time by name (perfetto trace), largest first."""
    import glob
    import gzip
    import shutil
    import tempfile

    d = tempfile.mkdtemp()
    with jax.profiler.trace(d, create_perfetto_trace=True):
        state, m = fn(state, batch)
        jax.block_until_ready(m)
    paths = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
    if not paths:
        return [f"no perfetto trace in {glob.glob(f'{d}/**/*', recursive=True)[:8]}"]
    slug = "".join(ch if ch.isalnum() else "_" for ch in name)[:40]
    shutil.copy(paths[0], os.path.join(OUT_DIR, f"trace_{slug}.json.gz"))
    with gzip.open(paths[0]) as fh:
        events = json.load(fh)
    events = events["traceEvents"] if isinstance(events, dict) else events
    pids = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    totals: dict = {}
    example: dict = {}
    for e in events:
        if e.get("ph") == "X" and "TPU" in str(pids.get(e.get("pid"), "")):
            key = (e.get("name"), e.get("tid"))
            totals[key] = totals.get(key, 0.0) + float(e.get("dur", 0.0))
            example.setdefault(key, str(e.get("args", ""))[:240])
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    rows = [f"{name} (tid {tid}): {us / 1e3:.1f} ms; {example[name, tid]}" for (name, tid), us in ranked]
    return [*rows, f"processes: {sorted(set(pids.values()))[:12]}"]


def section_exchange() -> dict:
    """The grouped MoE exchange (`grouped.exchange`) on a one-device mesh, the only exchange one chip
    has (with itself): its rows moved by `ragged_all_to_all` (what TPUs and GPUs get,
    `moe_costs.EXCHANGE_OP`) against all_to_all, outputs and gradients (JAX's transpose of the op)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from meshlm.model import grouped

    mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
    n, d, E = 512, 128, 8  # 256 tokens, top-2
    keys = jax.random.split(jax.random.key(0), 4)
    x, w = jax.random.normal(keys[0], (n // 2, d)), jax.random.normal(keys[1], (E, d, d)) / d**0.5
    expert = jax.random.randint(keys[2], (n,), 0, E)
    cot = jax.random.normal(keys[3], (n, d))

    def loss(x, w, ragged):
        def run(rows, ids):  # each received row times its expert's matrix (an empty slot: zeros)
            return jnp.einsum("rd,rde->re", rows, w[jnp.minimum(ids, E - 1)]) * (ids < E)[:, None]

        out = grouped.exchange(x, expert, jnp.arange(n) // 2, "expert", 1, E, run, ragged)
        return jnp.sum(out * cot)

    def both(x, w):
        return [jax.value_and_grad(loss, argnums=(0, 1))(x, w, r) for r in (True, False)]

    if jax.devices()[0].platform == "cpu":
        return "skipped: XLA:CPU does not implement ragged_all_to_all"
    run = partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    ragged, dense = jax.jit(run(both))(x, w)
    errors = [rel_err(a, b) for a, b in zip(jax.tree.leaves(ragged), jax.tree.leaves(dense), strict=True)]
    # one device's buffer holds the whole exchange above (sizes = [n]): the op itself with 4 uneven
    # slices, each to its own offset, value and gradient against gathers that say the same
    sizes, starts, there = (jnp.array(v, jnp.int32) for v in ([3, 0, 5, 2], [0, 3, 4, 10], [1, 6, 6, 12]))
    rows = jax.random.normal(keys[3], (12, d))

    def op(rows):
        out = jnp.zeros((16, d))
        return jax.lax.ragged_all_to_all(rows, out, starts, sizes, there, sizes, axis_name="expert")

    src = np.full(16, -1)
    for size, start, at in zip([3, 0, 5, 2], [0, 3, 4, 10], [1, 6, 6, 12], strict=True):
        src[at : at + size] = np.arange(start, start + size)
    want = lambda rows: jnp.where(jnp.asarray(src >= 0)[:, None], rows[jnp.asarray(np.maximum(src, 0))], 0.0)
    got = jax.jit(run(lambda r: jax.value_and_grad(lambda r: jnp.sum(op(r) * cot[:16]))(r)))(rows)
    ref = jax.value_and_grad(lambda r: jnp.sum(want(r) * cot[:16]))(rows)
    return {
        "ragged vs all_to_all self-exchange (loss, dx, dw) rel err": errors,
        "ragged_all_to_all, 4 uneven slices on one device (loss, grad) rel err": [
            rel_err(a, b) for a, b in zip(got, ref, strict=True)
        ],
    }


def section_loss(steps: int = 5) -> dict:
    """gpt-125m's train step (fused attention, elementwise, 32 microbatches) with the output layer and
    loss whole and in 4 and 16 token chunks (`remat.loss_chunks`): seconds per step (the median of
    `steps` after one warm step) and the program's peak, one variant at a time."""
    from meshlm import recipes
    from meshlm.config import ParallelConfig, RematConfig
    from meshlm.validation import validate

    sys.path.insert(0, os.path.dirname(__file__))
    from _timing import timed_steps

    base, out = recipes.get("gpt-125m"), {}
    m = dataclasses.replace(base.model, attention="fused", dropout=0.0)
    train = dataclasses.replace(base.train, microbatches=32)
    if SMOKE:
        m = dataclasses.replace(m, n_layers=2, d_model=128, n_heads=2, vocab_size=1024)
        train = dataclasses.replace(base.train, global_batch=8, seq_len=256, microbatches=2)
    for chunks in (1, 4, 16):
        remat = RematConfig(loss_chunks=chunks)
        c = validate(dataclasses.replace(base, model=m, parallel=ParallelConfig(), remat=remat, train=train))
        try:
            compiled, metrics, step_s, _ = timed_steps(c, steps)
            peak = compiled.memory_analysis().peak_memory_in_bytes / 2**30
            out[f"loss_chunks={chunks}"] = {"step s": step_s, "program peak GiB": peak, "loss": float(metrics["loss"])}
            del compiled
        except Exception as e:
            out[f"loss_chunks={chunks}"] = f"FAILED: {type(e).__name__}: {str(e)[:400]}"
        print(chunks, out[f"loss_chunks={chunks}"], flush=True)
    return out


OUT_DIR = "."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", nargs="+", default=["matmul", "kernels", "exchange", "attention", "grouped", "steps"])
    ap.add_argument("--recipes", nargs="+", default=["gpt-125m"])
    ap.add_argument("--steps", type=int, default=3, help="timed steps a variant (steps, loss)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    global OUT_DIR
    OUT_DIR = args.out
    dev = jax.devices()[0]
    RESULTS["device"] = f"{len(jax.devices())} x {dev.device_kind} (jax {jax.__version__})"
    print(RESULTS["device"], flush=True)
    for name in args.sections:
        t0 = time.perf_counter()
        try:
            fn = globals()[f"section_{name}"]
            RESULTS[name] = (
                fn(args.recipes, args.steps) if name == "steps" else fn(args.steps) if name == "loss" else fn()
            )
        except Exception:
            RESULTS[name] = "FAILED: " + traceback.format_exc()[-1500:]
        print(f"== {name} ({time.perf_counter() - t0:.0f} s)\n" + json.dumps(RESULTS[name], indent=1), flush=True)
        with open(os.path.join(args.out, "tpu.json"), "w") as fh:
            json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    main()
