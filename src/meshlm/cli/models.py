"""`meshlm convert`, `generate` and `eval`: a trained (or Hugging Face) model in use."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshlm.cli.common import inference_mesh, parse_bytes
from meshlm.config import EXPORT_DTYPES, ConfigError  # not safetensors_io's: ml_dtypes takes 0.4 s to load


def add_parsers(sub) -> dict:
    """The model-using subcommands; returns their handlers by name."""
    convert = sub.add_parser(
        "convert", help="Hugging Face checkpoints in and out: --from-hf DIR --to RUN_DIR, or --from RUN_DIR --to-hf DIR"
    )
    src = convert.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="a Hugging Face model directory (config.json + safetensors)")
    src.add_argument("--from", dest="from_run", metavar="RUN_DIR", help="a meshlm run directory")
    convert.add_argument("--to", metavar="RUN_DIR", help="with --from-hf: the meshlm run directory to write")
    convert.add_argument("--to-hf", metavar="DIR", help="with --from: the Hugging Face directory to write")
    convert.add_argument("--step", type=int, help="with --from: this checkpoint step (default: the latest good one)")
    convert.add_argument(
        "--peft", action="store_true", help="with --to-hf, a LoRA run: write only its adapters, as a PEFT adapter"
    )
    convert.add_argument(
        "--dtype",
        choices=EXPORT_DTYPES,
        default="float32",
        help="with --to-hf: the stored weights' dtype",
    )
    convert.add_argument(
        "--max-shard-size", default="2GiB", help="with --to-hf: split the weights into files of this size"
    )
    convert.add_argument(
        "--mesh", help="with --from-hf: place the weights on this mesh while converting (default: 1 device)"
    )
    convert.add_argument("--devices", type=int, help="simulated CPU devices (default: the mesh size)")
    gen = sub.add_parser("generate", help="sample text from a run (or hf:DIR) with a KV cache")
    gen.add_argument("--run-dir", required=True, help="a meshlm run directory, or hf:DIR for a Hugging Face directory")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable: one batch)")
    gen.add_argument("--prompt-file", help="a file with one prompt per line")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=0.95, help="... and the smallest set reaching this mass (1: all)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--step", type=int, help="this checkpoint step (default: the latest good one)")
    gen.add_argument("--mesh", help="e.g. tensor=4 (default: 1 device)")
    gen.add_argument("--devices", type=int, help="simulated CPU devices (default: the mesh size)")
    gen.add_argument("--json", action="store_true", help="print one JSON object (no streaming)")
    ev = sub.add_parser("eval", help="loss, perplexity and bits per byte of a run on a prepared split or text files")
    ev.add_argument("--run-dir", required=True, help="a meshlm run directory, or hf:DIR")
    ev.add_argument(
        "--data",
        nargs="+",
        default=[],
        help="a prepared dataset, or text/JSONL/Parquet files (default: the run's data)",
    )
    ev.add_argument("--split", default="val", choices=("train", "val"), help="split of a prepared dataset")
    ev.add_argument("--field", default="text", help="JSONL field / Parquet column of a document")
    ev.add_argument("--step", type=int)
    ev.add_argument("--seq-len", type=int, help="window length (default: the run's train.seq_len)")
    ev.add_argument("--batch-size", type=int, default=8)
    ev.add_argument("--max-tokens", type=int, default=0, help="evaluate at most this many tokens (0: all)")
    ev.add_argument("--mesh", help="e.g. data=2 or tensor=4 (default: 1 device)")
    ev.add_argument("--devices", type=int)
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.add_argument(
        "--tasks", default="", help="lm-evaluation-harness tasks, comma-separated (needs pip install 'meshlm[eval]')"
    )
    ev.add_argument("--num-fewshot", type=int, help="lm-eval: few-shot examples (default: each task's)")
    ev.add_argument("--limit", type=float, help="lm-eval: at most this many documents per task (< 1: a fraction)")
    ev.add_argument("--include-path", help="lm-eval: a directory of task YAML (and their local data files)")
    ev.add_argument("--output", help="lm-eval: write the results (and every sample's scores) as JSON here")
    return {"convert": cmd_convert, "generate": cmd_generate, "eval": cmd_eval}


def cmd_convert(args: argparse.Namespace) -> int:
    if args.from_hf:
        if not args.to or args.to_hf:
            raise ConfigError("meshlm convert --from-hf DIR needs --to RUN_DIR (a meshlm run directory)")
        parallel = inference_mesh(args)
        from meshlm.interop.convert import import_hf

        import_hf(args.from_hf, args.to, parallel)
        return 0
    if not args.to_hf or args.to:
        raise ConfigError("meshlm convert --from RUN_DIR needs --to-hf DIR (a Hugging Face directory)")
    if args.from_run.startswith("hf:"):
        raise ConfigError("--from hf:DIR is already a Hugging Face directory; --from takes a meshlm run directory")
    max_shard = parse_bytes(args.max_shard_size)
    parallel = inference_mesh(args)
    from meshlm.interop.convert import export_hf

    export_hf(args.from_run, args.to_hf, args.step, args.dtype, int(max_shard), parallel, peft=args.peft)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            prompts += [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
        except OSError as e:
            raise ConfigError(f"cannot read --prompt-file: {e}") from None
    if not prompts:
        raise ConfigError("give at least one --prompt (or --prompt-file)")
    parallel = inference_mesh(args)
    from meshlm.accounting import dtype_bytes
    from meshlm.inference import Generator, TextStream, load_model
    from meshlm.model.mla_costs import cache_bytes_per_token

    model = load_model(args.run_dir, args.step, parallel)
    ids = [model.encode(p) for p in prompts]
    if any(not i for i in ids):
        raise ConfigError("a prompt encodes to no tokens; give some text")
    stream = len(prompts) == 1 and not args.json
    if stream:
        print(prompts[0], end="", flush=True)
    out = Generator(model).generate(
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        on_token=TextStream(model, lambda piece: print(piece, end="", flush=True)) if stream else None,
    )
    texts = [model.decode(t) for t in out.tokens]
    if args.json:
        rows = zip(prompts, texts, out.tokens, strict=True)
        completions = [{"prompt": p, "completion": c, "tokens": t} for p, c, t in rows]
        timing = {k: getattr(out, k) for k in ("prefill_s", "first_decode_s", "decode_s", "decode_steps")}
        m = model.cfg.model  # the KV cache (MLA: the latent) per token, all layers, in the compute dtype
        cache = {"cache_bytes_per_token": cache_bytes_per_token(m, dtype_bytes(m.dtype))}
        print(json.dumps({"model": model.source, "completions": completions} | timing | cache))
        return 0
    if stream:
        print()
    else:
        for p, c in zip(prompts, texts, strict=True):
            print(f"{p}{c}\n---")
    print(
        f"[{model.source}: {sum(len(t) for t in out.tokens)} new tokens; {_timing(out, len(prompts))}]", file=sys.stderr
    )
    return 0


def _timing(out, rows: int) -> str:
    """Compile and steady decoding apart: the prefill and the first decode step each compile their
    program on first use; the rate counts only the decode steps after them."""
    text = f"prefill {out.prefill_s:.2f}s"
    if out.first_decode_s:
        text += f", first decode step {out.first_decode_s:.2f}s (both incl. compile)"
    else:
        text += " (incl. compile)"
    if out.decode_steps and out.decode_s > 0:
        text += f", then decode {out.decode_steps * rows / out.decode_s:.1f} tok/s over {out.decode_steps} steps"
    return text


def _eval_tasks(args: argparse.Namespace, parallel) -> int:
    """`meshlm eval --tasks`: lm-evaluation-harness through meshlm's model on its mesh."""
    from meshlm.inference import load_model
    from meshlm.interop.harness import run_tasks

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    model = load_model(args.run_dir, args.step, parallel)
    out = run_tasks(
        model, tasks, args.num_fewshot, args.limit, args.include_path, args.batch_size, log_samples=bool(args.output)
    )
    if args.output:
        from lm_eval.utils import handle_non_serializable

        Path(args.output).write_text(json.dumps(out, default=handle_non_serializable, indent=1))
    if args.json:
        print(json.dumps({"model": model.source, "results": out["results"]}, default=str))
    else:
        from lm_eval.utils import make_table

        print(make_table(out))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.max_tokens < 0 or (args.seq_len is not None and args.seq_len < 1):
        raise ConfigError("--batch-size and --seq-len must be >= 1, --max-tokens >= 0")
    parallel = inference_mesh(args)
    if args.tasks:
        return _eval_tasks(args, parallel)
    from meshlm.inference import eval_tokens, evaluate, evaluate_packed, load_model

    model = load_model(args.run_dir, args.step, parallel)
    run_dir = None if args.run_dir.startswith("hf:") else Path(args.run_dir)
    tokens, what = eval_tokens(model, args.data, args.split, run_dir, args.field)
    seq_len = args.seq_len or model.cfg.train.seq_len
    progress = None
    if sys.stderr.isatty() and not args.json:
        from rich.progress import Progress

        bar = Progress(transient=True)
        task = bar.add_task("evaluating", total=None)
        bar.start()
        progress = lambda done, total: bar.update(task, completed=done, total=total)
    packed = getattr(tokens, "packed", None)  # a packed chat / completion dataset: its rows, masked
    if packed and args.seq_len and args.seq_len != packed["seq_len"]:
        raise ConfigError(f"{tokens.root} is packed into rows of {packed['seq_len']} tokens; drop --seq-len")
    seq_len = packed["seq_len"] if packed else seq_len
    try:
        if packed:
            result = evaluate_packed(model, tokens, args.split, args.batch_size, args.max_tokens)
        else:
            result = evaluate(model, tokens, seq_len, args.batch_size, args.max_tokens, progress)
    finally:
        if progress is not None:
            bar.stop()
    result = {"model": model.source, "data": what, "seq_len": seq_len} | result
    if args.json:
        print(json.dumps(result))
    else:
        bpb = result["bits_per_byte"]
        print(
            f"{what}: {result['tokens']:,} tokens, {result['bytes']:,} bytes | loss {result['loss']:.4f} nats/token | "
            f"perplexity {result['perplexity']:.2f} | {'-' if bpb is None else f'{bpb:.4f}'} bits/byte"
        )
    return 0
