"""Where a run's metrics go besides metrics.jsonl: TensorBoard event files and Weights & Biases.

Every sink takes the same records the trainer writes to metrics.jsonl (`MetricsLogger.log`), so
there is one set of names: `TAGS` maps a record's key to its chart name. Sinks are created by
`open_sinks` once the run knows the step it starts from, and only on process 0.

- TensorBoard (`metrics.tensorboard`, default on): `tensorboardX` event files in <run_dir>/tb. A
  resumed run starts its writer with `purge_step` = the first step it redoes, so TensorBoard drops
  the interrupted attempt's points past the checkpoint: the curves continue without duplicates.
- Weights & Biases (`metrics.wandb=PROJECT`, the `wandb` extra): imported only when asked; offline
  (files under <run_dir>/wandb, `wandb sync` later) unless WANDB_MODE says otherwise or a login is
  configured, and offline too when W&B cannot be reached. The run id is derived from the run
  directory's path, so the attempts of one run log to one W&B run id.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Protocol

from meshlm.config import MetricsConfig

# record key -> chart name (a key missing here is not charted, e.g. "event")
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "skipped": "train/skipped_steps",
    "val_loss": "val/loss",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "mfu": "perf/mfu",
    "hfu": "perf/hfu",
    "checkpoint_save_s": "checkpoint/save_s",
    "moe_aux_loss": "moe/aux_loss",
    "moe_seq_aux_loss": "moe/seq_aux_loss",
    "moe_z_loss": "moe/z_loss",
    "dropped_fraction": "moe/dropped_fraction",
    "expert_load_max": "moe/load_max",
}


class Sink(Protocol):
    def scalars(self, step: int, values: dict[str, float]) -> None: ...
    def text(self, step: int, tag: str, text: str) -> None: ...
    def close(self, failed: bool = False) -> None: ...


def chart_values(record: dict) -> dict[str, float]:
    """The chartable numbers of a metrics record, under their chart names; an MoE run's
    `expert_load` [layer][expert] as one chart per expert, `moe/load/layer<l>/expert<e>` (l the
    model's layer: `moe_layers` lists them when some are dense); a
    mixture's tokens per source (`tokens/<source>`) as `data/tokens/<source>`."""
    out = {TAGS[k]: float(v) for k, v in record.items() if k in TAGS and isinstance(v, int | float)}
    out |= {f"data/{k}": float(v) for k, v in record.items() if k.startswith("tokens/")}
    out |= {f"train/{k}": float(v) for k, v in record.items() if k.startswith("mtp_loss_")}
    loads = record.get("expert_load") or ()
    for layer, row in zip(record.get("moe_layers") or range(len(loads)), loads, strict=True):
        out |= {f"moe/load/layer{layer}/expert{e}": float(v) for e, v in enumerate(row)}
    return out


def _summary_writer() -> type:
    """tensorboardX's SummaryWriter, imported without PyTorch: tensorboardX imports torch when it is
    installed (only to accept its tensors; meshlm passes floats and strings), which made every run's
    start-up 2.5-5 s longer wherever torch is installed beside meshlm."""
    if "torch" in sys.modules:  # imported already: nothing to save
        from tensorboardX import SummaryWriter

        return SummaryWriter
    # `import torch` raises ImportError, which tensorboardX handles. Process-wide for the import's
    # duration only (at start-up, in the main thread; a torch imported later loads as usual).
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoardSink:
    def __init__(self, run_dir: Path, start_step: int):
        SummaryWriter = _summary_writer()

        # purge_step: points after the checkpoint this attempt starts from, left by an interrupted
        # attempt (also one that never checkpointed: start 0), are dropped by TensorBoard
        self.writer = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, step)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


def _wandb_logged_in() -> bool:
    netrc = Path.home() / ".netrc"
    return bool(os.environ.get("WANDB_API_KEY")) or (netrc.exists() and "api.wandb.ai" in netrc.read_text())


class WandbSink:
    """A W&B run. Charts use meshlm's step as their x axis (`define_metric`), so a resumed attempt's
    points are kept (W&B's own step must only grow and would drop them); W&B then shows the steps an
    interrupted attempt redid twice, where TensorBoard shows them once."""

    def __init__(self, project: str, run_dir: Path, config: dict, quiet: bool = False, log=print):
        import wandb

        self.wandb = wandb
        settings = dict(silent=quiet, console="off", init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", 30)))
        kwargs = dict(project=project, dir=str(run_dir), config=config, name=run_dir.name, resume="allow")
        kwargs |= dict(id=hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16])
        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_logged_in() else "offline")
        try:
            self.run = wandb.init(mode=mode, settings=wandb.Settings(**settings), **kwargs)
        except Exception as e:  # no network: keep the run's metrics offline rather than fail the run
            if mode != "online":
                raise
            log(f"W&B is unreachable ({type(e).__name__}); logging offline to {run_dir / 'wandb'} (wandb sync later)")
            wandb.teardown()  # the failed attempt still holds the run id in W&B's service
            self.run = wandb.init(mode="offline", settings=wandb.Settings(**settings), **kwargs)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def text(self, step: int, tag: str, text: str) -> None:
        self.run.summary[tag] = text

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def open_sinks(
    cfg: MetricsConfig, run_dir: Path, start_step: int, config: dict, quiet: bool = False, log=print
) -> list[Sink]:
    """The sinks `cfg` asks for (`validate` has checked that their packages are installed)."""
    sinks: list[Sink] = []
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir, start_step))
    if cfg.wandb:
        sinks.append(WandbSink(cfg.wandb, run_dir, config, quiet, log))
    return sinks
