"""The non-finite step contract (`train.on_nonfinite`): a NaN batch injected at a chosen step is
never applied; `stop` halts at it, names it and checkpoints the last good state; `skip` skips it
(counted), keeps the data position and the optimizer step consistent, and stops after too many in
a row; checkpoints taken around it resume exactly."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import build, logged_losses, random_batches, tiny_config
from meshlm import step as step_module
from meshlm import train_loop
from meshlm.checkpoint import Checkpointer
from meshlm.config import CheckpointConfig, DataConfig
from meshlm.trainer import NonFiniteStep, train
from meshlm.validation import validate

POISON = 7  # a token id; a batch whose row 0 starts with it has a NaN loss


def _nan_gradient_if(x: jax.Array, poisoned: jax.Array) -> jax.Array:
    """x, unchanged forward; its gradient is NaN where `poisoned`."""

    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (jnp.where(poisoned, jnp.nan, g),))
    return f(x)


@pytest.fixture(params=["loss", "gradient"])
def poisonable(request, monkeypatch):
    """A batch whose first token is POISON has a NaN loss, or (param "gradient") a finite loss and
    a NaN gradient. Data-driven, so a resumed run meets it at the same step."""
    real = step_module.objective_sum

    def loss_sum(params, batch, cfg, layout, key):
        total, (ce, count, metrics) = real(params, batch, cfg, layout, key)
        poisoned = batch["inputs"][0, 0] == POISON
        if request.param == "gradient":
            return _nan_gradient_if(total, poisoned), (ce, count, metrics)
        return jnp.where(poisoned, jnp.nan, total), (jnp.where(poisoned, jnp.nan, ce), count, metrics)

    monkeypatch.setattr(step_module, "objective_sum", loss_sum)
    return request.param


def _batches(cfg, n, poisoned):
    out = random_batches(cfg, n, seed=2)
    for b in out:
        b["inputs"][0, 0] = (POISON + 1) % cfg.model.vocab_size
    for i in poisoned:
        out[i]["inputs"][0, 0] = POISON
    return out


def _run(cfg, batches):
    layout, _, tx, shardings, state = build(cfg)
    fn = step_module.make_train_step(cfg, layout, tx, shardings)
    states, metrics = [], []
    for b in batches:
        state, m = fn(state, b)
        states.append(jax.device_get(state))
        metrics.append(jax.device_get(m))
    return states, metrics


def _same_params(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(np.array_equal, a.params, b.params)))


def test_stop_freezes_the_state_at_the_last_good_step(poisonable, devices):
    cfg = tiny_config("gpt", dict(data=2, tensor=4, sequence_parallel=True))
    states, metrics = _run(cfg, _batches(cfg, 4, poisoned=[1]))
    assert [int(s.step) for s in states] == [1, 1, 1, 1]  # nothing after the bad step is consumed
    assert [bool(s.halted) for s in states] == [False, True, True, True]
    assert [bool(m["applied"]) for m in metrics] == [True, False, False, False]
    assert all(_same_params(s, states[0]) for s in states[1:])
    bad = metrics[1]["loss"] if poisonable == "loss" else metrics[1]["grad_norm"]
    assert np.isnan(bad) and np.isfinite(metrics[2]["loss"])  # later steps run, unapplied
    if poisonable == "gradient":
        assert np.isfinite(metrics[1]["loss"])  # only the gradient was bad


def test_skip_keeps_data_position_and_optimizer_step_consistent(poisonable, devices):
    """skip with max_consecutive_skips=1: bad steps 2, 4 and 5 (1-based); 2 and 4 are skipped,
    5 is the second in a row and halts. Adam's own step count is always step - skipped."""
    cfg = tiny_config("llama", dict(fsdp=2, tensor=4), steps=6)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, on_nonfinite="skip", max_consecutive_skips=1))
    states, metrics = _run(cfg, _batches(cfg, 6, poisoned=[1, 3, 4]))
    assert [int(s.step) for s in states] == [1, 2, 3, 4, 4, 4]
    assert [int(s.skipped) for s in states] == [0, 1, 1, 2, 2, 2]
    assert [int(s.streak) for s in states] == [0, 1, 0, 1, 1, 1]
    assert [bool(s.halted) for s in states] == [False, False, False, False, True, True]
    assert _same_params(states[1], states[0]) and not _same_params(states[2], states[1])
    assert _same_params(states[3], states[2]) and _same_params(states[4], states[3])
    for s in states:
        adam_count = int(s.opt_state[1][0].count)
        assert adam_count == int(s.step) - int(s.skipped)
    # the learning rate a step reports is the one its update used: the schedule follows updates
    schedule = step_module.lr_schedule(cfg.optim, cfg.train.steps)
    assert metrics[2]["lr"] == pytest.approx(float(schedule(1)))  # third batch, second update


# ----------------------------------------------------------------------------- via the trainer


def _cfg(corpus, cache, on_nonfinite="stop", **train_kw):
    cfg = tiny_config("gpt", dict(data=2, tensor=2), steps=12, log_every=5, eval_every=0, seq_len=32)
    return validate(
        dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, vocab_size=320),
            train=dataclasses.replace(cfg.train, on_nonfinite=on_nonfinite, **train_kw),
            data=DataConfig(paths=(str(corpus),), cache_dir=str(cache)),
            checkpoint=CheckpointConfig(every=4, keep=10),
        )
    )


@pytest.fixture
def poison_steps(monkeypatch, poisonable):
    """Steps (0-based batch index) whose batch the trainer feeds with POISON first."""
    steps: set[int] = set()
    real = train_loop.process_batch

    def process_batch(loader, step, sharding):
        b = real(loader, step, sharding)
        first = POISON if step in steps else (POISON + 1)
        return b | {"inputs": jax.device_put(b["inputs"].at[0, 0].set(first), sharding)}

    monkeypatch.setattr(train_loop, "process_batch", process_batch)
    return steps


def _state(cfg, run_dir):
    from meshlm.parallel.mesh import make_layout
    from meshlm.train_state import abstract_state, setup

    layout = make_layout(cfg.parallel)
    specs, tx, _ = setup(cfg, layout)
    ck = Checkpointer(run_dir / "checkpoints", CheckpointConfig(), read_only=True)
    return ck.steps(), ck.restore_latest(abstract_state(specs, layout, tx))


@pytest.mark.slow
@pytest.mark.parametrize("poisonable", ["loss", "gradient"], indirect=True)
def test_stop_names_the_step_checkpoints_the_last_good_state_and_resumes_exactly(
    corpus_dir, tmp_path, poison_steps, poisonable, monkeypatch
):
    cfg = _cfg(corpus_dir, tmp_path / "cache")
    train(cfg, tmp_path / "ref", quiet=True)  # no poison: the reference run

    beats = []  # forced heartbeats: the halt's save must not look like a hang to `meshlm launch`
    beat = train_loop.Heartbeat.beat
    monkeypatch.setattr(
        train_loop.Heartbeat,
        "beat",
        lambda self, step, force=False: (beats.append((step, force)), beat(self, step, force)),
    )
    poison_steps.add(6)  # the 7th step
    # a NaN loss (the poison selects it with `where`) has a zero gradient; a NaN gradient a finite loss
    values = r"loss=nan, grad_norm=0\.0" if poisonable == "loss" else r"loss=[0-9.]+, grad_norm=nan"
    with pytest.raises(NonFiniteStep, match=rf"non-finite loss or gradient at step 7 \({values}\)") as e:
        train(cfg, tmp_path / "a", quiet=True)
    assert "the state of step 6 is checkpointed" in str(e.value)
    assert beats[-4:] == [(6, True)] * 4, beats  # on each side of the halt's save and of its commit
    saved, restored = _state(cfg, tmp_path / "a")
    assert saved == [4, 6] and int(restored.state.step) == 6  # halted before the periodic save at 8

    poison_steps.clear()  # the data is fixed: rerun the same command
    train(cfg, tmp_path / "a", quiet=True)
    assert logged_losses(tmp_path / "a") == logged_losses(tmp_path / "ref")
    ref, got = _state(cfg, tmp_path / "ref")[1], _state(cfg, tmp_path / "a")[1]
    assert int(got.state.step) == 12 and _same_params(got.state, ref.state)


@pytest.mark.slow
@pytest.mark.parametrize("poisonable", ["loss"], indirect=True)
def test_skip_is_counted_checkpointed_and_resumes_exactly(corpus_dir, tmp_path, poison_steps, capsys):
    """Steps 7 and 10 skipped (10 is a logged step): counted, said, logged as strict JSON; a run
    interrupted in between and resumed equals the uninterrupted one bit for bit."""
    cfg = _cfg(corpus_dir, tmp_path / "cache", on_nonfinite="skip")
    poison_steps.update({6, 9})
    train(cfg, tmp_path / "ref")  # uninterrupted, with the skips; not quiet: the console says so
    out = capsys.readouterr().out
    assert "step 7: non-finite loss (nan) or gradient norm (0.0); update skipped (1 skipped so far)" in out
    assert "step 10/12 | loss skipped (non-finite)" in out
    train(cfg, tmp_path / "a", quiet=True, stop_after=9)  # checkpoints 4, 8, 9
    saved, restored = _state(cfg, tmp_path / "a")
    assert saved == [4, 8, 9] and restored.meta["skipped"] == 1 and int(restored.state.skipped) == 1
    train(cfg, tmp_path / "a", quiet=True)
    assert logged_losses(tmp_path / "a") == logged_losses(tmp_path / "ref")
    ref, got = _state(cfg, tmp_path / "ref")[1], _state(cfg, tmp_path / "a")[1]
    assert int(got.state.step) == 12 and int(got.state.skipped) == 2 and _same_params(got.state, ref.state)
    assert int(got.state.opt_state[1][0].count) == 10  # 12 batches, 10 updates

    def strict(constant):  # NaN / Infinity are not JSON
        raise ValueError(f"metrics.jsonl holds {constant}")

    lines = (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line, parse_constant=strict) for line in lines]
    skipped = [r for r in events if r.get("event") == "skipped"]
    assert [(r["step"], r["skipped"], r["bad_loss"]) for r in skipped] == [(7, 1, "nan"), (10, 2, "nan")]
    logged = {r["step"]: r for r in events if "loss" in r and "event" not in r}
    assert logged[10]["loss"] is None and logged[10]["skipped"] == 2 and logged[12]["loss"] > 0


@pytest.mark.parametrize("poisonable", ["gradient"], indirect=True)
def test_too_many_consecutive_skips_stop(corpus_dir, tmp_path, poison_steps):
    cfg = _cfg(corpus_dir, tmp_path / "cache", on_nonfinite="skip", max_consecutive_skips=2)
    poison_steps.update({2, 3, 4})  # steps 3, 4, 5: the third in a row halts
    with pytest.raises(
        NonFiniteStep, match=r"3 consecutive non-finite steps \(3\.\.5; train.max_consecutive_skips=2\)"
    ):
        train(cfg, tmp_path / "a", quiet=True)
    _, restored = _state(cfg, tmp_path / "a")
    assert int(restored.state.step) == 4 and int(restored.state.skipped) == 2  # 3 and 4 skipped, 5 not consumed
