"""In-memory checkpoints (`local_checkpoint`) in one process: each distinct shard stored once, the
state rebuilt bit for bit onto its shardings, and every copy that must not be used (another
layout, a failed digest, older than the disk's) refused. The ring between processes and the
recovery of a killed or replaced process are in test_multiprocess."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers import build, tiny_config
from meshlm import local_checkpoint as lc
from meshlm.train_state import abstract_state


def _state(mesh: dict, shard_optimizer: bool = False):
    cfg = tiny_config(mesh=mesh)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, shard_optimizer=shard_optimizer))
    layout, specs, tx, _, state = build(cfg)
    return state, abstract_state(specs, layout, tx, shard_optimizer=shard_optimizer)


def _equal(a, b) -> bool:
    same = jax.tree.map(lambda x, y: x.sharding == y.sharding and np.array_equal(x, y), a, b)
    return all(jax.tree.leaves(same))


@pytest.fixture(scope="module")
def zero1():
    """data=2 x tensor=4 with ZeRO-1: weights replicated over data, their moments split over it."""
    return _state(dict(data=2, tensor=4), shard_optimizer=True)


def test_a_copy_holds_each_distinct_shard_once_and_rebuilds_the_state_bit_for_bit(zero1):
    state, abstract = zero1
    blob = lc.encode(state, {"step": 0}, lc.layout_fingerprint(abstract))
    header, body = lc.decode(blob)
    # one process holding every device: the distinct shards tile each tensor exactly once, so the
    # copy is the state's size, not the 8 devices' (replicated weights are stored once)
    assert len(body) == sum(x.nbytes for x in jax.tree.leaves(state))
    per_device = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards)
    assert per_device > 1.4 * len(body)  # what a copy of every device's shards would hold
    assert _equal(lc.rebuild(header, body, abstract), state)
    damaged = bytearray(blob)
    damaged[-3] ^= 1
    with pytest.raises(ValueError, match="digest"):
        lc.decode(bytes(damaged))


def test_the_fingerprint_tells_layouts_apart(zero1):
    _, abstract = zero1
    _, again = _state(dict(data=2, tensor=4), shard_optimizer=True)  # built anew: the same layout
    _, plain = _state(dict(data=2, tensor=4))  # the same mesh without ZeRO-1: other moment shardings
    _, other = _state(dict(fsdp=2, tensor=4), shard_optimizer=True)
    prints = [lc.layout_fingerprint(a) for a in (abstract, again, plain, other)]
    assert prints[0] == prints[1] and len(set(prints)) == 3


def test_one_process_keeps_its_newest_copy_and_refuses_the_ones_it_must_not_use(zero1, tmp_path):
    state, abstract = zero1
    messages = []
    store = lc.LocalCheckpoints(tmp_path / "store", every=2, log=messages.append)
    assert [n for n in range(1, 7) if store.due(n)] == [2, 4, 6]

    def save(step):
        at = jax.device_put(np.int32(step), state.step.sharding)
        store.save(state._replace(step=at), {"tokenizer_fingerprint": "t"})

    save(2), save(4)
    assert sorted(p.name for p in store.own.iterdir()) == ["4.ckpt"]  # the older copy pruned
    got = store.restore(abstract, disk_step=3)
    assert got.step == 4 and got.meta["tokenizer_fingerprint"] == "t" and got.from_peer == []
    assert int(got.state.step) == 4 and _equal(got.state._replace(step=state.step), state)
    assert store.restore(abstract, disk_step=5) is None  # the disk has a newer step: the copy goes
    assert not any(store.own.iterdir())
    save(4)
    _, plain = _state(dict(data=2, tensor=4))
    assert store.restore(plain, disk_step=None) is None  # cut for another layout
    save(4)
    path = store.own / "4.ckpt"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert store.restore(abstract, disk_step=None) is None and "failed its digest" in messages[-1]
    store.delete()
    assert not (tmp_path / "store").exists()


def test_the_group_takes_the_newest_step_every_process_has_a_copy_of():
    """`choose` over four processes' reports: own steps (k = 2 here), held steps (of process j -
    shift), the disk's newest step each process sees."""
    none = [-1, -1]

    def table(own, held, disk):
        return np.array([[*o, *h, d] for o, h, d in zip(own, held, disk, strict=True)])

    full = [[6, 5]] * 4
    assert lc.choose(table(full, full, [3] * 4), 2, 1) == (6, [])
    # process 2's host replaced: its copies gone; process 3 holds its step 6
    lost = [[6, 5], [6, 5], none, [6, 5]]
    assert lc.choose(table(lost, [[6, 5], [6, 5], none, [6, 5]], [3] * 4), 2, 1) == (6, [2])
    # shift 2 (two processes per host): process 0 holds process 2's copy
    assert lc.choose(table(lost, [[6, 5], [6, 5], none, none], [3] * 4), 2, 2) == (6, [2])
    assert lc.choose(table(lost, [[6, 5], [6, 5], none, none], [3] * 4), 2, 1) == (None, [])
    # killed during a save: process 1 wrote 7, the others had not; 6 is everywhere
    assert lc.choose(table([[6, 5], [7, 6], [6, 5], [6, 5]], full, [3] * 4), 2, 1) == (6, [])
    # one process sees a newer disk step than the copies: the disk wins for all
    assert lc.choose(table(full, full, [3, 3, 9, 3]), 2, 1) == (None, [])


def test_lengths_of_two_gib_and_more_cross_processes_whole_and_peers_sit_on_other_hosts():
    values = [0, 1, 2**31 - 1, 2**31, 3 * 10**9, 5 * 10**12]
    words = lc._words(values)
    assert words.dtype == np.int32  # what JAX moves between processes without x64
    np.testing.assert_array_equal(lc._unwords(words[None])[0], values)
    assert lc.peer_shift([7, 7, 9, 9]) == 2 and lc.peer_shift([7, 9, 7, 9]) == 1
    assert lc.peer_shift([7, 7, 9, 9, 4, 4]) == 2 and lc.peer_shift([7, 7, 7]) == 1


def test_a_failed_write_turns_the_copies_off_and_training_goes_on(zero1, tmp_path):
    state, _ = zero1
    (tmp_path / "store").write_text("a file where the store's directory should be")
    messages = []
    store = lc.LocalCheckpoints(tmp_path / "store", every=1, log=messages.append)
    store.save(state, {})
    assert store.disabled and not store.due(2)
    assert "in-memory checkpoints turned off at step 0" in messages[0] and "Error" in messages[0]


def test_the_store_is_per_run_directory_and_per_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    ra = lc.run_id(a, first=True)
    assert lc.run_id(a, first=True) == ra == lc.run_id(a, first=False)  # written once
    (b / ".run-id").write_text(ra)  # a copy of run a's directory
    assert lc.store_dir(tmp_path, a, ra) != lc.store_dir(tmp_path, b, ra)
    (a / ".run-id").unlink()  # the run dir made again
    assert lc.store_dir(tmp_path, a, lc.run_id(a, first=True)) != lc.store_dir(tmp_path, a, ra)
