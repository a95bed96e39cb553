"""UMA under the aten dispatch equals one process: graph partition (plain and MoLE) and halo.

The partition's helpers hand the backbone aten ShardTensors (NOTE [aten graph partition]
in `mlipdd.shard.aten.graph_partition`), so every op of eSCN-MD on the owned block and the
kept edges runs through an aten rule; a mixture-of-experts backbone routes each system's
weight to its edge rows (NOTE [MoLE under the aten dispatch]). Under halo storage the
graph, positions and virial adapters have their aten forms (NOTE [UMA under the aten
dispatch] in `mlipdd_uma.halo`). float32: the limit is 30 x the model's own permutation
noise, as in test_uma_conformance.py. Small systems: UMA is slow on CPU.
"""

from __future__ import annotations

import pytest
from mlipdd.testing.conformance import check_conformance_cases
from test_uma_conformance import FACTORY, FLOOR, NOISE_FACTOR, _permutation_noise
from test_uma_mole_graph_partition import FACTORY as MOLE_FACTORY
from test_uma_mole_graph_partition import _limits as mole_limits
from uma_systems import batch_of_two, triclinic_cell


@pytest.mark.mlipdd_conformance(world_sizes=(2,))
def test_uma_aten_graph_partition_matches_single_process(world_size):
    batch = triclinic_cell()
    limits = {k: max(NOISE_FACTOR * v, FLOOR) for k, v in _permutation_noise(batch).items()}
    config = {"strategy": "graph_partition"}
    ((result, _),) = check_conformance_cases([(FACTORY, batch, config)], world_size, timeout=600.0)
    result.assert_close(**limits)
    assert float(result.reference["stress"].abs().max()) > 1e-4


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_uma_aten_halo_matches_single_process(world_size):
    batch = triclinic_cell()
    limits = {k: max(NOISE_FACTOR * v, FLOOR) for k, v in _permutation_noise(batch).items()}
    config = {"strategy": "halo"}
    ((result, _),) = check_conformance_cases([(FACTORY, batch, config)], world_size, timeout=600.0)
    result.assert_close(**limits)
    assert float(result.reference["stress"].abs().max()) > 1e-4


@pytest.mark.mlipdd_conformance(world_sizes=(2,))
def test_mole_aten_graph_partition_matches_single_process(world_size):
    systems = {"triclinic": triclinic_cell(), "two_systems": batch_of_two()}
    cases = [(MOLE_FACTORY, batch, {"strategy": "graph_partition"}) for batch in systems.values()]
    for name, (result, _) in zip(systems, check_conformance_cases(cases, world_size, timeout=600.0)):
        for key, limit in mole_limits(systems[name]).items():
            assert result.rel_diff[key] < limit, f"{name} {key}: {result.rel_diff[key]:.2e} >= {limit:.2e}"


def _cluster_and_lone_atoms():
    """A 3-atom cluster and three atoms farther than the cutoff from everything, in a 30 A
    cell: under graph partition the ranks owning only lone atoms keep no edge at all."""
    import torch
    from mlipdd.data import AtomicData, Batch

    positions = torch.tensor([[5.0, 5.0, 5.0], [6.1, 5.0, 5.0], [5.0, 6.0, 5.2],
                              [15.0, 15.0, 15.0], [22.0, 22.0, 8.0], [8.0, 22.0, 22.0]])
    data = AtomicData(positions=positions, atomic_numbers=torch.tensor([6, 1, 8, 1, 8, 6]),
                      cell=torch.eye(3) * 30.0, pbc=True, dtype=torch.float32)
    return Batch.from_data_list([data])


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3))
def test_a_rank_without_edges_matches_single_process(world_size):
    """fairchem pads an edgeless graph with a fake edge (`add_n_empty_edges`, a cat the aten
    dispatch refuses); under the aten dispatch an edgeless rank runs on its zero edge rows."""
    batch = _cluster_and_lone_atoms()
    ((result, _),) = check_conformance_cases([(FACTORY, batch, {"strategy": "graph_partition"})], world_size,
                                             timeout=600.0)
    result.assert_close(**{k: FLOOR for k in ("energy", "forces", "stress")})
    assert float(result.reference["forces"][:3].abs().max()) > 1e-3  # the cluster's forces are real
