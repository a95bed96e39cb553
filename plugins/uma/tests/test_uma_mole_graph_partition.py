"""A mixture-of-experts (MoLE) UMA backbone under graph partition equals one process.

Released UMA-S checkpoints route 32 expert copies of every SO(2) weight by each system's
composition and charge/spin/task embedding (`eSCNMDMoeBackbone`). Under graph partition
every rank sees the whole system, so the routing needs no adapter; what could still break
is the per-system split of the edge rows (``mole_sizes`` counts each rank's own edges per
system). The batch of two systems exercises that split. Tolerance as in
test_uma_conformance.py: 30 x the model's own permutation noise.
"""

from __future__ import annotations

import functools

import pytest
import torch
from mlipdd.testing.conformance import check_conformance_cases, relative_difference
from mlipdd_uma.testing import mole_settings, random_uma_wrapper
from uma_systems import batch_of_two, triclinic_cell

FACTORY = functools.partial(random_uma_wrapper, mole_settings(4), seed=0, task="omat")
FLOOR = 30 * torch.finfo(torch.float32).eps


def _limits(batch) -> dict:
    model = FACTORY()
    reference = model(batch.clone(), compute_stress=True)
    perm = torch.cat([torch.randperm(int(n), generator=torch.Generator().manual_seed(0)) + int(start)
                      for start, n in zip(batch.ptr[:-1], batch.atoms_per_system)])
    out = model(batch.select_atoms(perm), compute_stress=True)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(len(perm))
    return {key: max(30 * relative_difference((out[key][inverse] if key == "forces" else out[key]).detach(),
                                              reference[key].detach()), FLOOR)
            for key in ("energy", "forces", "stress")}


def test_random_mole_model_is_a_mixture_of_experts():
    backbone = FACTORY().model.backbone
    assert type(backbone).__name__ == "eSCNMDMoeBackbone" and backbone.num_experts == 4
    assert backbone.use_composition_embedding


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_mole_graph_partition_matches_single_process(world_size):
    systems = {"triclinic": triclinic_cell(), "two_systems": batch_of_two()}
    cases = [(FACTORY, batch, {"strategy": "graph_partition"}) for batch in systems.values()]
    for name, (result, _) in zip(systems, check_conformance_cases(cases, world_size)):
        limits = _limits(systems[name])
        for key, limit in limits.items():
            assert result.rel_diff[key] < limit, f"{name} {key}: {result.rel_diff[key]:.2e} >= {limit:.2e}"
        assert float(result.reference["stress"].abs().max()) > 1e-4
