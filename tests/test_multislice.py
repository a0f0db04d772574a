"""Meshes over several TPU slices or GPU nodes (`--dcn`): each axis splits `dcn` ways across them
and the rest within one, `tensor` never across; the device assignment is checked on stand-in device
objects (no pod at hand), the errors and the planner's slow links on the real config."""

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np
import pytest

from meshlm import recipes
from meshlm.config import ConfigError, ParallelConfig, parse_mesh
from meshlm.insight import plan
from meshlm.parallel.mesh import hybrid_devices, make_mesh
from meshlm.platform.hardware import ACCELERATORS
from meshlm.validation import validate


@dataclass(frozen=True)
class StandIn:
    """What `mesh_utils` reads of a device: TPUs are laid out by slice and chip coordinates, other
    platforms by process (one per node)."""

    id: int
    platform: str
    process_index: int = 0
    slice_index: int = 0
    coords: tuple = (0, 0, 0)
    core_on_chip: int = 0
    device_kind: str = "stand-in"


def _shuffled(devices: list[StandIn]) -> list[StandIn]:
    """In no particular order, as a runtime may list them: a plain reshape would mix the nodes."""
    return [devices[i] for i in np.random.default_rng(0).permutation(len(devices))]


def gpu_nodes(nodes: int, per_node: int) -> list[StandIn]:
    kind = "NVIDIA H100"
    return _shuffled(
        [StandIn(n * per_node + i, "gpu", n, device_kind=kind) for n in range(nodes) for i in range(per_node)]
    )


def tpu_slices(slices: int) -> list[StandIn]:  # 2x2x2 chips per slice
    cube = [(x, y, z) for z in range(2) for y in range(2) for x in range(2)]
    chips = [(s, i, c) for s in range(slices) for i, c in enumerate(cube)]
    return _shuffled([StandIn(s * 8 + i, "tpu", slice_index=s, coords=c, device_kind="TPU v4") for s, i, c in chips])


def _where(array: np.ndarray, attr: str) -> np.ndarray:
    return np.vectorize(lambda d: getattr(d, attr))(array)


@pytest.mark.parametrize(
    "mesh, dcn, split_axis",
    [
        (dict(data=4, tensor=2), dict(dcn_data=2), "data"),
        (dict(data=2, fsdp=2, tensor=2), dict(dcn_fsdp=2), "fsdp"),
        (dict(stage=2, data=2, tensor=2), dict(dcn_stage=2), "stage"),
    ],
)
def test_an_axis_splits_across_nodes_and_tensor_stays_within_one(mesh, dcn, split_axis):
    """2 nodes x 4 GPUs: the axis named in --dcn changes node at its outer half (its first half on
    node 0); every other axis - tensor above all - varies within a node."""
    par = validate_parallel(ParallelConfig(**mesh, **dcn))
    array = hybrid_devices(par, gpu_nodes(2, 4))
    assert array.shape == tuple(getattr(par, a) for a in par.dcn)  # (stage, data, fsdp, context, tensor)
    node = _where(array, "process_index")
    axis = list(par.dcn).index(split_axis)
    index = np.indices(array.shape)[axis]
    np.testing.assert_array_equal(node, index // (array.shape[axis] // 2))
    assert len({d.id for d in array.flat}) == 8


def test_the_expert_axis_may_cross_nodes():
    """`--dcn expert=2` (DeepSeek-V3 ran EP64 over 8 nodes): the experts' all_to_all spans nodes,
    its first half of the expert axis on node 0; the planner prices it at the inter-node bandwidth."""
    assert parse_mesh("expert=2", dcn=True) == {"dcn_expert": 2}
    moe = recipes.get("moe-tiny")
    par = validate(dataclasses.replace(moe, parallel=ParallelConfig(expert=4, tensor=2, dcn_expert=2))).parallel
    array = hybrid_devices(par, gpu_nodes(2, 4))
    node = _where(array, "process_index")
    np.testing.assert_array_equal(node, np.indices(array.shape)[list(par.dcn).index("expert")] // 2)
    h800 = ACCELERATORS["h800"]
    inside = dataclasses.replace(moe, parallel=ParallelConfig(expert=2, tensor=2))
    across = dataclasses.replace(moe, parallel=ParallelConfig(expert=2, tensor=2, dcn_expert=2))
    for cfg, bandwidth in ((inside, h800.intra_bw), (across, h800.inter_bw)):
        want = plan.expert_exchange_bytes(cfg) / bandwidth
        assert plan.estimate(cfg, h800).time["expert all_to_all"] == pytest.approx(want, rel=1e-12)


def test_tpu_slices_hold_contiguous_blocks_of_the_split_axis():
    par = validate_parallel(ParallelConfig(data=4, fsdp=2, tensor=2, dcn_data=2))
    array = hybrid_devices(par, tpu_slices(2))
    slice_of = _where(array, "slice_index")
    np.testing.assert_array_equal(slice_of, np.indices(array.shape)[1] // 2)
    for s in range(2):  # each slice: its 8 chips, once each
        assert sorted(d.id for d in array.flat if d.slice_index == s) == list(range(8 * s, 8 * s + 8))


def test_the_wrong_number_of_slices_is_a_clear_error():
    par = ParallelConfig(data=4, tensor=2, dcn_data=2)
    with pytest.raises(
        ConfigError, match=r"splits the mesh over 2 processes \(one per node\), but the devices come from 4"
    ):
        hybrid_devices(par, gpu_nodes(4, 2))
    with pytest.raises(ConfigError, match="but the devices come from 1"):  # one process of simulated CPUs
        make_mesh(par, jax.devices()[:8])


def validate_parallel(par: ParallelConfig) -> ParallelConfig:
    cfg = recipes.get("tiny")
    return validate(dataclasses.replace(cfg, parallel=par)).parallel


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tensor=2", "the tensor axis stays within a slice or node"),
        ("pipe=2", "unknown mesh axis 'pipe' in --dcn"),
        ("data=two", "--dcn data needs an integer size"),
    ],
)
def test_bad_dcn_specs(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_mesh(spec, dcn=True)


def test_dcn_must_divide_its_axis():
    assert parse_mesh("data=2,stage=2", dcn=True) == {"dcn_data": 2, "dcn_stage": 2}
    with pytest.raises(ConfigError, match=r"parallel.dcn_data=3 must be >= 1 and divide parallel.data=4"):
        validate_parallel(ParallelConfig(data=4, dcn_data=3))
    par = ParallelConfig(data=4, tensor=2, dcn_data=2)
    assert par.n_slices == 2 and par.describe() == "data=4 fsdp=1 tensor=2 (dcn data=2)"


def test_the_planner_prices_collectives_across_slices_at_the_slow_link():
    """gpt-1.3b, data=8 on H100s (one node's worth): its gradient all-reduce over NVLink, or - when
    data splits across two nodes - over the network, slower by exactly the bandwidths' ratio."""
    h100 = ACCELERATORS["h100"]
    cfg = recipes.get("gpt-1.3b")
    one = dataclasses.replace(cfg, parallel=ParallelConfig(data=8))
    two = dataclasses.replace(cfg, parallel=ParallelConfig(data=8, dcn_data=2))
    part = "data/FSDP collectives"
    fast, slow = (plan.estimate(c, h100).time[part] for c in (one, two))
    assert slow / fast == pytest.approx(h100.intra_bw / h100.inter_bw)
