"""`meshlm convert`: a Hugging Face directory -> a meshlm run directory, and back.

Import writes a run directory holding config.json (the model from the Hugging Face config, the
other sections meshlm's defaults), tokenizer.json (when the source has one) and a weights-only
checkpoint at step 0, which `train --init-from`, `generate`, `eval` and `convert --to-hf` read.
Both directions write under a temporary name and rename when complete: a failure leaves nothing
half-written at the destination.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from meshlm.config import ConfigError, DataConfig, ParallelConfig, RunConfig, TrainConfig
from meshlm.data import tokenizer as toks
from meshlm.interop import hf, hf_tables
from meshlm.validation import validate


def _fresh_dir(path: str | Path) -> Path:
    out = Path(path).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; convert into a new directory")
    return out


def import_hf(
    hf_dir: str | Path, run_dir: str | Path, parallel: ParallelConfig | None = None, log: Callable[[str], None] = print
) -> Path:
    import jax

    from meshlm.checkpoint import Checkpointer
    from meshlm.model.params import param_specs
    from meshlm.parallel.mesh import make_layout
    from meshlm.train_state import param_shardings
    from meshlm.version import code_version

    root = Path(hf_dir).expanduser()
    model = hf_tables.model_config(root)
    hf.weight_files(root)  # refuses pickles before anything is written
    ids = hf.token_ids(root)  # and a malformed generation_config.json
    out = _fresh_dir(run_dir)
    tok_src = root / "tokenizer.json"
    tok = toks.load(tok_src) if tok_src.is_file() else None
    parallel = dataclasses.replace(parallel or ParallelConfig(), sequence_parallel=False)
    cfg = RunConfig(
        model=model,
        parallel=parallel,
        data=DataConfig(tokenizer=str(out / "tokenizer.json") if tok else ""),
        # eval's default window: the model's context, up to 1024 tokens
        train=TrainConfig(global_batch=max(16, parallel.batch_shards), seq_len=min(1024, model.max_seq_len)),
    )
    cfg = validate(cfg)
    layout = make_layout(cfg.parallel)
    params = hf.load_params(root, model, param_shardings(param_specs(model), layout))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        meta = {
            "code_version": code_version(),
            "config": cfg.to_dict(),
            "tokenizer_fingerprint": toks.fingerprint(tok) if tok else None,
            "source": f"hf:{root.absolute()}",
        }
        ckpt = Checkpointer(tmp / "checkpoints", cfg.checkpoint, log=log)
        try:
            ckpt.save_params(params, meta)
            ckpt.wait()
        finally:
            ckpt.close()
        if tok:
            shutil.copyfile(tok_src, tmp / "tokenizer.json")
        for f in hf.SIDE_FILES:  # chat template, bos/eos and stop ids travel with the model
            if (root / f).is_file():
                shutil.copyfile(root / f, tmp / f)
        (tmp / "config.json").write_text(cfg.to_json())
        (tmp / "converted.json").write_text(json.dumps({"from": str(root.absolute())} | ids, indent=2))
        hf.publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(x.size for x in jax.tree.leaves(params))
    log(f"imported {root} ({model.family}, {n:,} parameters) -> {out}")
    log(f"  use it: meshlm train --init-from {out} ... | meshlm generate --run-dir {out} --prompt ...")
    return out


def export_hf(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    dtype: str = "float32",
    max_shard_bytes: int = 2 * 2**30,
    parallel: ParallelConfig | None = None,
    log: Callable[[str], None] = print,
    peft: bool = False,
) -> Path:
    """A run's model as a Hugging Face directory; a LoRA run's adapters folded into their base
    weights (`model.lora.merged`), or with `peft` only the adapters, as a PEFT adapter directory."""
    from meshlm.inference import load_model, run_tokenizer_file
    from meshlm.model.lora import merged

    out = _fresh_dir(out_dir)
    model = load_model(run_dir, step, parallel, base=not peft)  # a PEFT adapter: the adapters alone
    if peft:
        from meshlm.sources import hf_base

        base = hf_base(model.meta.get("base", {}).get("source", ""))  # where the step's adapters point
        if not base:
            log(
                "  warning: the run's base is no Hugging Face directory meshlm knows; load the adapter onto it yourself"
            )
        return hf.save_peft(model.params, model.cfg.model, out, base, log)
    params, model_cfg = merged(model.params, model.cfg.model)
    if model_cfg is not model.cfg.model:
        log(f"  folding the LoRA adapters (r={model.cfg.model.lora_rank}) into their base weights")
    root = Path(run_dir).expanduser()
    tok_file = run_tokenizer_file(root)  # the file load_model read the tokenizer from
    if tok_file is None:
        log(f"  warning: {root} has no tokenizer; the export holds weights and config only")
    eos = toks.eot_token(model.tokenizer) if model.tokenizer is not None else None
    return hf.save_pretrained(
        params,
        model_cfg,
        out,
        tokenizer_file=tok_file,
        eos_token=eos,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        max_positions=model.cfg.train.seq_len,
        side_files=root,
        log=log,
    )
