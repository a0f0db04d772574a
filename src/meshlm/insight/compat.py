"""The compatibility matrix: `meshlm check` over meshlm's options, written to docs/compatibility.md.

The options are factors (family, mesh layout, attention kernel, remat policy, dtype, document
masking). Their full product is hours of checks on 2 cores, so the default matrix is an all-pairs
design: every pair of values of two factors appears in at least one row (greedy, seeded), which is
where composition bugs live (a loss scaled twice under one strategy and one remat policy). `--full`
runs the product. Each row is checked (its largest relative error against the tolerance), refused
(config validation's message: a combination meshlm does not run must be refused before anything
compiles, never crash) or not run.

    python -m meshlm.insight.compat --write      # the default matrix into docs/compatibility.md

Each finished row is appended to a journal (`<cache>/compat/<commit>.jsonl`, only for a clean
checkout): a run that dies (XLA:CPU aborts the process when a collective's rendezvous waits past
40 s, which a long matrix run on 2 cores has hit after 61 rows while each row alone passes) is run
again and goes on from the next row, and the table's time is the rows' summed time.

Imports no JAX at module level: `main` sets the simulated device count first.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from meshlm.config import ConfigError, RunConfig, apply_overrides, cache_home
from meshlm.validation import validate

DEVICES = 8  # every layout below fits in 8 simulated devices
# Mesh layouts, each as `--mesh`-style overrides (+ what the layout needs to run: microbatches for
# pipelines). On CPU `fused` attention is the blockwise kernel, so it is no column of its own.
MESHES: dict[str, tuple[str, ...]] = {
    "data=2": ("parallel.data=2",),
    "fsdp=2": ("parallel.fsdp=2",),
    "tensor=2": ("parallel.tensor=2",),
    "tensor=2+SP": ("parallel.tensor=2", "parallel.sequence_parallel=true"),
    "data=2 x tensor=2+SP": ("parallel.data=2", "parallel.tensor=2", "parallel.sequence_parallel=true"),
    "fsdp=2 x tensor=2": ("parallel.fsdp=2", "parallel.tensor=2"),
    "expert=2": ("parallel.expert=2",),
    "expert=2 x tensor=2+SP": ("parallel.expert=2", "parallel.tensor=2", "parallel.sequence_parallel=true"),
    "context=2 ring": ("parallel.context=2", "parallel.context_strategy=ring"),
    "context=2 all_gather": ("parallel.context=2", "parallel.context_strategy=all_gather"),
    "context=2 all_to_all": ("parallel.context=2", "parallel.context_strategy=all_to_all"),
    "context=2 x tensor=2+SP ring": (
        "parallel.context=2",
        "parallel.tensor=2",
        "parallel.sequence_parallel=true",
        "parallel.context_strategy=ring",
    ),
    "stage=2 gpipe": ("parallel.stage=2", "parallel.pipeline_schedule=gpipe", "train.microbatches=2"),
    "stage=2 1f1b": ("parallel.stage=2", "parallel.pipeline_schedule=1f1b", "train.microbatches=4"),
    "stage=2 interleaved v=2": (
        "parallel.stage=2",
        "parallel.pipeline_schedule=interleaved",
        "parallel.virtual_stages=2",
        "train.microbatches=2",
    ),
    "stage=2 x tensor=2+SP 1f1b": (
        "parallel.stage=2",
        "parallel.tensor=2",
        "parallel.sequence_parallel=true",
        "train.microbatches=2",
    ),
    "stage=2 zb1": ("parallel.stage=2", "parallel.pipeline_schedule=zb1", "train.microbatches=4"),
    "stage=2 1f1b single ticks": (
        "parallel.stage=2",
        "parallel.pipeline_schedule=1f1b",
        "parallel.pipeline_ticks=single",
        "train.microbatches=4",
    ),
    "stage=2 x fsdp=2 zbv": (
        "parallel.stage=2",
        "parallel.fsdp=2",
        "parallel.pipeline_schedule=zbv",
        "parallel.virtual_stages=2",
        "parallel.pipeline_ticks=single",
        "train.microbatches=4",
    ),
    "stage=2 x context=2 x tensor=2 ring zb1": (
        "parallel.stage=2",
        "parallel.context=2",
        "parallel.tensor=2",
        "parallel.context_strategy=ring",
        "parallel.pipeline_schedule=zb1",
        "train.microbatches=4",
    ),
    "stage=2 x context=2 all_gather": (
        "parallel.stage=2",
        "parallel.context=2",
        "parallel.context_strategy=all_gather",
        "train.microbatches=2",
    ),
    "stage=2 x data=2 x context=2 all_to_all": (
        "parallel.stage=2",
        "parallel.data=2",
        "parallel.context=2",
        "parallel.context_strategy=all_to_all",
        "train.microbatches=2",
    ),
}
FACTORS: dict[str, tuple] = {
    "family": ("gpt", "llama", "moe"),
    "mesh": tuple(MESHES),
    "attention": ("explicit", "blockwise"),
    "remat": ("elementwise", "selective", "full", "dots", "offload"),
    "dtype": ("float32", "bfloat16"),
    "document_mask": (False, True),
}
DOC = Path(__file__).resolve().parents[3] / "docs" / "compatibility.md"
# gpt's recipe has dropout 0.1 (P2's model), llama none; moe is llama with 8 experts, top-2 (capacity 1.25)
RECIPES = {"gpt": "tiny", "llama": "llama-tiny", "moe": "moe-tiny"}
BASE = ("model.attention_block=32", "model.attention_chunk=32", "train.seq_len=64")


def config_for(row: dict) -> RunConfig:
    """The run config of one row: the family's recipe with the row's options, as `--set` would give
    them (unvalidated: validation is part of the check)."""
    from meshlm import recipes

    cfg = recipes.get(RECIPES[row["family"]])
    if row["family"] == "gpt":
        cfg = apply_overrides(cfg, ["model.dropout=0.1"])
    sets = [*BASE, "parallel.data=1", "parallel.expert=1", *MESHES[row["mesh"]], f"model.attention={row['attention']}"]
    sets += [f"remat.policy={row['remat']}", f"model.dtype={row['dtype']}"]
    packed = str(row["document_mask"]).lower()  # packed rows, as chat data trains: document and loss masks
    sets += [f"data.document_mask={packed}", f"data.loss_mask={packed}"]
    return apply_overrides(cfg, sets)


def all_rows() -> Iterator[dict]:
    for values in itertools.product(*FACTORS.values()):
        yield dict(zip(FACTORS, values, strict=True))


def _pairs(row: dict) -> set:
    items = sorted(row.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def runs(row: dict) -> bool:
    """Whether config validation accepts the row (no JAX): the rows it refuses are listed as such."""
    return _runs(tuple(row.items()))


@functools.cache
def _runs(items: tuple) -> bool:
    try:
        validate(config_for(dict(items)))
    except ConfigError:
        return False
    return True


def _cover(rows: list[dict], pairs: set) -> list[dict]:
    """Greedy: each next row is the one covering the most of `pairs` not yet covered (the first such)."""
    chosen, uncovered, row_pairs = [], set(pairs), [_pairs(r) for r in rows]
    while uncovered:
        best = max(range(len(rows)), key=lambda i: len(row_pairs[i] & uncovered))
        chosen.append(rows[best])
        uncovered -= row_pairs[best]
    return chosen


def all_pairs(seed: int = 0) -> list[dict]:
    """A small set of rows in which every pair of values of two factors that meshlm runs is in a
    row that runs (and so is checked), and every pair it refuses in a refused row (greedy covers;
    ties broken by a seeded shuffle)."""
    rows = list(all_rows())
    random.Random(seed).shuffle(rows)
    ok = [runs(r) for r in rows]
    valid, refused = (
        [r for r, v in zip(rows, ok, strict=True) if v],
        [r for r, v in zip(rows, ok, strict=True) if not v],
    )
    checked_pairs = set().union(*(_pairs(r) for r in valid))
    refused_pairs = set().union(*(_pairs(r) for r in rows)) - checked_pairs
    return _cover(valid, checked_pairs) + _cover(refused, refused_pairs)


def check_row(row: dict) -> dict:
    """One row's outcome: {"result": "checked" | "differs" | "refused", "error", "tolerance", "dtype"
    (the one it was checked in), "why"}."""
    from meshlm.insight.check import run_check

    try:
        r = run_check(config_for(row))
    except ConfigError as e:
        return {"result": "refused", "why": str(e).split(";")[0]}
    except Exception as e:  # a combination must be refused by validation, never crash: a failure
        return {"result": "crashed", "why": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    worst = max([r.loss_error, r.grad_norm_error, *(e.error for e in r.leaves)])
    out = {"result": "checked" if r.equal else "differs", "error": worst, "tolerance": r.tolerance, "dtype": r.dtype}
    return out | ({"why": ", ".join(r.mismatched) or "loss / gradient norm"} if not r.equal else {})


def _cell(outcome: dict | None) -> str:
    if outcome is None:
        return "not run"
    if outcome["result"] in ("refused", "crashed"):
        return f"{'**CRASHED**' if outcome['result'] == 'crashed' else 'refused'}: {outcome['why']}"
    mark = "checked" if outcome["result"] == "checked" else "**DIFFERS**"
    return f"{mark}, {outcome['error']:.1e} (tol {outcome['tolerance']:g})"


def markdown(rows: list[dict], outcomes: list[dict | None], how: str, seconds: float) -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    counts = {
        k: sum(1 for o in outcomes if o and o["result"] == k) for k in ("checked", "differs", "refused", "crashed")
    }
    lines = [
        "# Compatibility matrix",
        "",
        f"Generated by `{how}` at commit {commit or 'unknown'} on {time.strftime('%Y-%m-%d')}, "
        f"{DEVICES} simulated CPU devices, in {seconds / 60:.1f} min: {len(rows)} rows, "
        f"{counts['checked']} checked equal to one device, {counts['differs']} differing, {counts['refused']} "
        f"refused by config validation, {counts['crashed']} crashed.",
        "",
        "Each row is `meshlm check` of one combination (the model shrunk to its check size, docs/check.md):",
        "one step's raw gradients, loss and gradient norm on the layout against one device. *checked*: the",
        "largest relative error over every parameter, the loss and the norm, within the dtype's tolerance;",
        "*refused*: the configuration error meshlm gives before compiling. Every pair of option values",
        "that meshlm runs is in at least one checked row, and every pair it refuses in a refused row (an",
        f"all-pairs design over the factors below); `--full` runs all {len(list(all_rows()))} combinations.",
        "gpt runs with dropout 0.1 (P2's model), llama without; moe is moe-tiny (llama, 8 experts, top-2,",
        "capacity factor 1.25).",
        "",
        "| # | family | mesh | attention | remat | dtype | packed rows (document + loss masks) | result |",
        "|---:|---|---|---|---|---|---|---|",
    ]
    for i, (row, out) in enumerate(zip(rows, outcomes, strict=True), 1):
        mask = "on" if row["document_mask"] else "off"
        ran = (out or {}).get("dtype", row["dtype"])  # an MoE row asked in bf16 is checked in fp32 (docs/check.md)
        dtype = row["dtype"] if ran == row["dtype"] else f"{row['dtype']}, checked in {ran}"
        lines.append(
            f"| {i} | {row['family']} | {row['mesh']} | {row['attention']} | {row['remat']} | {dtype} | "
            f"{mask} | {_cell(out)} |"
        )
    return "\n".join(lines) + "\n"


def _journal() -> Path | None:
    """This commit's journal of finished rows; None when tracked files have changes (rows checked on
    uncommitted code must not be reused)."""
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=DOC.parent).stdout.strip()
    commit = git("rev-parse", "HEAD")
    if not commit or git("status", "--porcelain", "--untracked-files=no"):
        return None
    return cache_home() / "compat" / f"{commit}.jsonl"


def _read_journal(path: Path) -> dict[str, dict]:
    out = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # the line a killed run was writing
            continue
        out[entry["row"]] = entry["outcome"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshlm.insight.compat", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="the full product instead of the all-pairs rows")
    ap.add_argument("--seed", type=int, default=0, help="the all-pairs design's tie-breaking seed")
    ap.add_argument("--write", action="store_true", help="write docs/compatibility.md")
    ap.add_argument("--out", default=str(DOC), help="default: docs/compatibility.md of this checkout")
    args = ap.parse_args(argv)
    from meshlm.platform.xla_flags import prepare_backend

    prepare_backend(DEVICES, cpu=True)  # before JAX is imported
    rows = list(all_rows()) if args.full else all_pairs(args.seed)
    journal = _journal()
    done = {} if journal is None or not journal.is_file() else _read_journal(journal)
    outcomes, seconds = [], 0.0
    for i, row in enumerate(rows, 1):
        key = json.dumps(row, sort_keys=True)
        if key not in done:
            t0 = time.time()
            done[key] = check_row(row) | {"seconds": time.time() - t0}
            if journal is not None:
                journal.parent.mkdir(parents=True, exist_ok=True)
                with journal.open("a") as f:
                    f.write(json.dumps({"row": key, "outcome": done[key]}) + "\n")
        outcomes.append(done[key])
        seconds += done[key]["seconds"]
        print(f"[{i}/{len(rows)}] {row} -> {_cell(outcomes[-1])}", file=sys.stderr, flush=True)
    how = "python -m meshlm.insight.compat" + (" --full" if args.full else "") + " --write"
    text = markdown(rows, outcomes, how, seconds)
    if args.write:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 1 if any(o["result"] in ("differs", "crashed") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
