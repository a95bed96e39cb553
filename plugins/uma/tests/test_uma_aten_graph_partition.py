"""UMA under graph partition with the aten dispatch equals one process (2 gloo ranks).

The partition's helpers hand the backbone aten ShardTensors (NOTE [aten graph partition]
in `mlipdd.shard.aten.graph_partition`), so every op of eSCN-MD on the owned block and the
kept edges runs through an aten rule. float32: the limit is 30 x the model's own
permutation noise, as in test_uma_conformance.py. One small system: UMA is slow on CPU.
"""

from __future__ import annotations

import pytest
from mlipdd.testing.conformance import check_conformance_cases
from test_uma_conformance import FACTORY, FLOOR, NOISE_FACTOR, _permutation_noise
from uma_systems import triclinic_cell


@pytest.mark.mlipdd_conformance(world_sizes=(2,))
def test_uma_aten_graph_partition_matches_single_process(world_size):
    batch = triclinic_cell()
    limits = {k: max(NOISE_FACTOR * v, FLOOR) for k, v in _permutation_noise(batch).items()}
    config = {"strategy": "graph_partition", "dispatch": "aten"}
    ((result, _),) = check_conformance_cases([(FACTORY, batch, config)], world_size, timeout=600.0)
    result.assert_close(**limits)
    assert float(result.reference["stress"].abs().max()) > 1e-4
