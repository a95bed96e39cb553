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
