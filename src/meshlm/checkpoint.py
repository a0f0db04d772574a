"""Orbax checkpoints of the train state: layout-independent, asynchronous, verified on restore.

A checkpoint directory holds one sub-directory per saved step. Orbax writes each into a temporary
name and renames it when every process has finished (the atomic commit), so a half-written step
is never listed. Each step holds three items:

    params     fp32 master weights: global arrays stored shard by shard (tensorstore/OCDBT), so they
               restore onto any mesh and device count, each process reading only its own shards.
               A LoRA run's (meta has "base") hold its adapters only: the frozen base is where
               meta["base"] points, with its checksums (`sources.with_base` reads and checks it)
    opt_state  the optimizer state, the same way
    meta       JSON: step (= the data position: batch n is a pure function of (seed, n)), the
               non-finite counters (skipped steps, current streak), the resolved config, code
               version, tokenizer and data identity, and for every tensor its shape, dtype and a
               checksum of its bits

The checksum (two wrapping uint32 sums over the raw bits, one position-weighted) is computed on
device from the global arrays, so it does not depend on the layout: restoring onto another mesh
must reproduce it exactly. A step whose files cannot be read or whose checksums disagree is moved
aside (`<dir>.corrupt/`, never deleted) and the previous good step is used instead.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from meshlm.config import CheckpointConfig, ConfigError
from meshlm.model import lora
from meshlm.model.params import named_leaves
from meshlm.train_state import TrainState

ITEMS = ("params", "opt_state", "meta")


class CheckpointError(RuntimeError):
    """No readable checkpoint where one was asked for (`--init-from` a directory whose steps all
    fail to restore), or, in a multi-process run, a step this process alone could not read (moved
    aside; restart the group). A path with no checkpoint at all is a ConfigError."""


class CheckpointSpace(CheckpointError):
    """The checkpoint directory ran out of space during a save. Nothing was committed for that
    step (Orbax writes into a temporary directory that no restore lists); the committed steps are
    intact. Final for `meshlm launch`: a restart would fill the disk again."""


def _out_of_space(e: BaseException) -> bool:
    text = f"{e}"
    full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
    return full or "No space left on device" in text or "Disk quota exceeded" in text


def _committed(directory: Path) -> list[int]:
    """The steps on disk (a step in flight or failed is still under its temporary name); from the
    directory itself, as Orbax's own list names a failed step from the moment its save began."""
    return sorted(int(p.name) for p in directory.iterdir() if _is_step_dir(p)) if directory.is_dir() else []


# Set once a multi-process save failed: Orbax's save threads then wait on a barrier that a failed
# process never reaches (for AsyncOptions.timeout_secs, 20 minutes), and an interpreter that joins
# them at exit would wait as long; the CLI exits without joining them (`os._exit`).
ABANDONED_THREADS: list[str] = []


class _SaveErrors(logging.Handler):
    """A failed asynchronous write, caught as Orbax logs it from its `async_save` thread. Orbax
    raises it only when the next save or wait joins that thread, which in a multi-process run first
    waits on a barrier with the other processes: they wait in turn, on their own barrier, for the
    failed one."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.error: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and threading.current_thread().name == "async_save" and self.error is None:
            self.error = record.exc_info[1]


class ChecksumMismatch(ValueError):
    """Restored bits differ from the saved checksums (seen alike by every process)."""


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """[sum of the bits, sum of the bits x (flat index % 65521 + 1)], as wrapping uint32 sums: one
    variadic reduce over elementwise terms, which XLA fuses, so no leaf-sized temporary is made."""
    if jax.typeof(x).memory_space == jax.memory.Space.Host:  # offloaded optimizer state: summed on the device
        x = jax.device_put(x, jax.memory.Space.Device)
    bits_dtype = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, bits_dtype).astype(jnp.uint32)
    index, stride = jnp.zeros(x.shape, jnp.uint32), 1  # the flat index (mod 2^32), from one iota per axis
    for axis in reversed(range(x.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= x.shape[axis]
    weight = index % 65521 + 1
    zero = jnp.uint32(0)
    add = lambda a, b: (a[0] + b[0], a[1] + b[1])
    total, weighted = jax.lax.reduce((bits, bits * weight), (zero, zero), add, tuple(range(x.ndim)))
    return jnp.stack([total, weighted])


@jax.jit
def _checksums(tree: Any) -> Any:
    return jax.tree.map(_leaf_checksum, tree)


def describe(tree: Any) -> dict[str, dict]:
    """Shape, dtype and bit checksum of every tensor of a pytree of (global) arrays."""
    sums = named_leaves(jax.device_get(_checksums(tree)))
    return {
        name: {"shape": list(x.shape), "dtype": str(x.dtype), "checksum": [int(v) for v in sums[name]]}
        for name, x in named_leaves(tree).items()
    }


def shape_mismatches(saved: dict[str, dict], abstract: Any) -> list[str]:
    """Human-readable differences between saved tensor metadata and the shapes a config expects."""
    want = {n: (list(x.shape), str(x.dtype)) for n, x in named_leaves(abstract).items()}
    have = {n: (d["shape"], d["dtype"]) for n, d in saved.items()}
    out = []
    for n, (shape, dtype) in want.items():
        if n not in have:
            out.append(f"{n}: in the config, not in the checkpoint")
        elif have[n] != (shape, dtype):
            out.append(f"{n}: checkpoint {have[n][0]} {have[n][1]}, config {shape} {dtype}")
    return out + [f"{n}: in the checkpoint, not in the config" for n in have if n not in want]


@dataclass(frozen=True)
class Restored:
    state: TrainState
    meta: dict


def _is_step_dir(p: Path) -> bool:
    return p.is_dir() and p.name.isdigit()


def resolve_checkpoint(path: str | Path, what: str = "--init-from") -> tuple[Path, int | None]:
    """A run directory, a checkpoints directory or one step directory -> (checkpoints dir, step or
    None). A path that holds no checkpoint is bad input (ConfigError), caught before any work;
    `what` names the argument in the message."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{what} path not found: {p}")
    if not p.is_dir():
        raise ConfigError(f"{what} {p} is a file; give a run directory, its checkpoints directory or a step")
    if _is_step_dir(p) and (p / "meta").exists():
        return p.parent, int(p.name)
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if not any(_is_step_dir(c) for c in p.iterdir()):
        raise ConfigError(f"{what}: no checkpoint under {p} (expected step directories such as {p}/100)")
    return p, None


class _DropReadOnlyNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Given directory is read only")


@contextlib.contextmanager
def _quiet_read_only_notice():
    """Orbax logs "Given directory is read only=..." (absl, WARNING) whenever a read-only manager is
    made, i.e. on every `meshlm generate` / `eval`: asked for, so not worth a warning to the user."""
    logger, drop = logging.getLogger("absl"), _DropReadOnlyNotice()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _in_flight_gb(tree: Any) -> float:
    """Orbax's limit on the bytes a save or restore of `tree` holds in flight besides the arrays
    themselves: a quarter of the tree, and at least 1.2x its largest tensor (Orbax refuses a
    single read or write above the limit). At Orbax's default (96 GB, in effect unlimited) a save
    held a full host copy of the tree and a restore read it all at once
    (benchmarks/convert_memory.py)."""
    sizes = [math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)]
    return max(1.2 * max(sizes, default=1), 0.25 * sum(sizes)) / 1e9


class Checkpointer:
    """Save / restore-latest over one checkpoint directory (an `ocp.CheckpointManager`)."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig, log=print, read_only: bool = False):
        self.directory = Path(directory).expanduser().absolute()
        self.cfg, self.log = cfg, log
        # read-only (generate, eval, convert, --init-from): the options a reader has, so that Orbax
        # has nothing to override and warn about on every call
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else cfg.keep,
            keep_period=None if read_only else cfg.keep_every or None,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=cfg.async_save,
            create=not read_only,
            read_only=read_only,
        )
        with _quiet_read_only_notice():
            self.manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)
        self.last_saved: int | None = None
        self.errors = _SaveErrors()
        if not read_only:
            logging.getLogger("absl").addHandler(self.errors)

    # ------------------------------------------------------------------------------- save

    def save(self, state: TrainState, meta: dict) -> int:
        """Start saving `state` at its step; returns as soon as the arrays are copied off the
        devices (the write continues in the background, so the caller may donate `state`)."""
        step = int(jax.device_get(state.step))
        if step == self.last_saved or step in self.manager.all_steps():
            return step
        params = lora.adapters(state.params) if meta.get("base") else state.params  # LoRA: the adapters only
        tensors = describe({"params": params, "opt_state": state.opt_state})  # one pass, one compile
        counters = {"skipped": int(jax.device_get(state.skipped)), "streak": int(jax.device_get(state.streak))}
        meta = meta | counters | {"step": step, "saved_at": time.time(), "tensors": tensors}
        self._agree()
        with self._space(step):
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(params),
                    opt_state=ocp.args.StandardSave(state.opt_state),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )
        self.last_saved = step
        return step

    @contextlib.contextmanager
    def _space(self, step: int | None):
        """A full disk, seen by a save or by the wait for an asynchronous one, as one clear error."""
        try:
            yield
        except Exception as e:
            if not _out_of_space(e):
                raise
            # an asynchronous save fails when the next save (or the wait) looks at it: name that step
            pending = self.last_saved is not None and self.last_saved not in self.manager.all_steps()
            raise self._full(self.last_saved if pending or step is None else step) from e

    def _full(self, step: int | None, where: str = "") -> CheckpointSpace:
        at = f" while saving step {step}" if step is not None else ""
        return CheckpointSpace(
            f"no space left (or over quota) on the device of {self.directory}{where}{at}: that step was not "
            f"committed (its temporary directory is never restored); committed checkpoints "
            f"{_committed(self.directory)} are intact. Free space, lower checkpoint.keep or set "
            "checkpoint.dir elsewhere, then rerun to resume"
        )

    def _agree(self) -> None:
        """Multi-process runs, before anything waits on the previous asynchronous save: the processes
        agree (a host all-gather, polled) that it committed everywhere, or that it failed somewhere,
        and then every process raises the failure at once, a full disk as CheckpointSpace (exit 5 on
        every process, which `meshlm launch` does not retry). Waiting on Orbax instead would hold
        every process for 20 minutes (`_SaveErrors`)."""
        if jax.process_count() == 1:
            return
        from jax.experimental import multihost_utils

        while True:  # 0 committed, 1 in flight, 2 failed, 3 failed for want of space
            error = self.errors.error
            mine = 2 + _out_of_space(error) if error is not None else int(self.manager.is_saving_in_progress())
            states = np.asarray(multihost_utils.process_allgather(np.int32(mine)))
            if not states.any():
                return
            if (states >= 2).any():
                break
            time.sleep(0.05)
        ABANDONED_THREADS.append(str(self.directory))
        who = f" (process(es) {np.flatnonzero(states >= 2).tolist()})"
        if (states == 3).any():
            raise self._full(self.last_saved, who) from error
        raise CheckpointError(
            f"the save of step {self.last_saved} in {self.directory} failed{who}: {error or 'see its log'}"
        ) from error

    def save_params(self, params: dict, meta: dict, step: int = 0) -> int:
        """A weights-only checkpoint (`meshlm convert --from-hf`): what `--init-from`, `generate`,
        `eval` and `convert --to-hf` read; a run resumes only from full train states."""
        meta = meta | {
            "step": step,
            "saved_at": time.time(),
            "params_only": True,
            "tensors": describe({"params": params}),
        }
        # Saved through a manager of its own, whose handler bounds the host copies in flight (the
        # trainer's saves copy everything off the devices at once, so that the state can be donated)
        gb = _in_flight_gb(params)
        handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=gb, save_device_host_concurrent_gb=gb)
        manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={"params": handler, "meta": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True),
        )
        try:
            args = ocp.args.Composite(params=ocp.args.PyTreeSave(params), meta=ocp.args.JsonSave(meta))
            manager.save(step, args=args, force=True)
            manager.wait_until_finished()
        finally:
            manager.close()
        self.manager.reload()
        self.last_saved = step
        return step

    def _params_only(self, step: int) -> bool:
        try:
            return bool(self.read_meta(step).get("params_only"))
        except Exception:  # unreadable meta: the restore below reports and quarantines it
            return False

    def wait(self) -> None:
        """Block until every started save is committed."""
        self._agree()
        with self._space(None):
            self.manager.wait_until_finished()

    def close(self) -> None:
        logging.getLogger("absl").removeHandler(self.errors)
        if str(self.directory) in ABANDONED_THREADS:  # its threads wait on a barrier that is never met
            return
        try:
            with self._space(None):
                self.manager.wait_until_finished()
        finally:
            self.manager.close()

    # ---------------------------------------------------------------------------- restore

    def steps(self) -> list[int]:
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def read_meta(self, step: int) -> dict:
        return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    def _quarantine(self, step: int, reason: str) -> None:
        src = self.directory / str(step)
        aside = self.directory.with_name(self.directory.name + ".corrupt")
        dst = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        for n in range(1, 1000):  # the same step set aside twice in one second (a redone step corrupt again)
            if not dst.exists():
                break
            dst = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
        self.log(f"checkpoint {src} is unusable ({reason}); moved to {dst}, falling back to the previous one")
        if src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                src.rename(dst)
        self.manager.reload()

    def _check_shapes(self, step: int, meta: dict, abstract: dict[str, Any]) -> None:
        saved = {k: v for k, v in meta["tensors"].items() if k.split("/", 1)[0] in abstract}
        problems = []
        for item, tree in abstract.items():
            sub = {k.split("/", 1)[1]: v for k, v in saved.items() if k.startswith(item + "/")}
            problems += [f"{item}/{p}" for p in shape_mismatches(sub, tree)]
        if problems:
            raise ConfigError(
                f"checkpoint {self.directory / str(step)} does not match the model config; mismatched tensors:\n  "
                + "\n  ".join(problems[:20])
                + ("\n  ..." if len(problems) > 20 else "")
                + "\nuse the config the checkpoint was saved with (its config is in its meta item), or a new run dir"
            )

    def _restore_step(self, step: int, abstract: dict[str, Any]) -> tuple[dict, dict]:
        """(restored items, meta) for one step; ConfigError on a shape mismatch, other exceptions
        when the files are unreadable or the checksums disagree."""
        meta = self.read_meta(step)
        if meta.get("base") and "params" in abstract:  # a LoRA run's: the adapters only (the caller adds the base)
            if not lora.adapters(abstract["params"])["layers"]:
                raise ConfigError(
                    f"{self.directory / str(step)} is a LoRA run's checkpoint: it holds the adapters only; fold them "
                    "into their base first (meshlm convert --from RUN --to-hf OUT) and start from --init-from hf:OUT"
                )
            abstract = abstract | {"params": lora.adapters(abstract["params"])}
        self._check_shapes(step, meta, abstract)
        gb = _in_flight_gb(abstract)  # read buffers in flight bounded, as for save_params
        handlers = {k: ocp.StandardCheckpointHandler(restore_concurrent_gb=gb) for k in abstract}
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
        with _quiet_read_only_notice():
            reader = ocp.CheckpointManager(self.directory, item_handlers=handlers, options=options)
        try:
            args = {k: ocp.args.StandardRestore(v) for k, v in abstract.items()}
            restored = reader.restore(step, args=ocp.args.Composite(**args))
        finally:
            reader.close()
        items = {k: restored[k] for k in abstract}
        for name, d in describe(items).items():
            if d["checksum"] != meta["tensors"][name]["checksum"]:
                raise ChecksumMismatch(f"checksum mismatch in {name}")
        return items, meta

    def restore_latest(self, abstract_state: TrainState, step: int | None = None) -> Restored | None:
        """The newest good checkpoint (or exactly `step`), restored into `abstract_state`'s
        shardings; None when there is none. Unreadable steps are moved aside, never overwritten.
        A LoRA run's state comes back with its adapters only as parameters (`sources.with_base`)."""
        candidates = [step] if step is not None else list(reversed(self.steps()))
        abstract = {"params": abstract_state.params, "opt_state": abstract_state.opt_state}
        for s in candidates:
            if self._params_only(s):
                raise ConfigError(
                    f"checkpoint {self.directory / str(s)} holds weights only (written by `meshlm convert`); "
                    f"start a run from it with --init-from {self.directory.parent}, in a new run dir"
                )
            try:
                items, meta = self._restore_step(s, abstract)
            except ConfigError:
                raise
            except Exception as e:  # unreadable files, bad JSON, checksum mismatch
                self._quarantine(s, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                if jax.process_count() > 1 and not isinstance(e, ChecksumMismatch):
                    # Files only some processes may fail to read: the others are already past this
                    # step, so falling back here alone would desynchronise the group. Stop; a restart
                    # (meshlm launch does it) finds the step gone and every process takes the previous one.
                    raise CheckpointError(
                        f"checkpoint step {s} is unreadable on process {jax.process_index()}; "
                        "moved aside, restart the run to resume from the previous step"
                    ) from e
                continue
            scalar = lambda v, dtype=np.int32: jax.device_put(dtype(v), abstract_state.step.sharding)
            counters = [
                scalar(meta.get(k, 0)) for k in ("skipped", "streak")
            ]  # 0 in checkpoints older than the counters
            state = TrainState(
                scalar(meta["step"]), items["params"], items["opt_state"], *counters, scalar(0, np.bool_)
            )
            return Restored(state, meta)
        return None

    def restore_params(self, abstract_params: dict, step: int | None = None) -> tuple[dict, dict]:
        """Only the parameters of the newest good (or the given) step (`--init-from`, `generate`,
        `eval`, `convert`); a LoRA run's adapters only (`sources.with_base`)."""
        candidates = [step] if step is not None else list(reversed(self.steps()))
        errors = []
        for s in candidates:
            try:
                items, meta = self._restore_step(s, {"params": abstract_params})
                return items["params"], meta
            except ConfigError:
                raise
            except Exception as e:
                errors.append(f"step {s}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        raise CheckpointError(f"no readable checkpoint in {self.directory}: " + "; ".join(errors or ["none saved"]))
