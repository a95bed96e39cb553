"""Multi-rank conformance: distributed MACE equals single-process MACE.

Uses the core's kit (`mlipdd.testing.conformance_suite`): the awkward cells
(cubic, triclinic, a cell where ranks see their own images, a slab with
vacuum, a batch of two systems), each run on spawned gloo ranks and compared with one
process to 1e-10 in float64, under halo storage and under sharded storage. The model is rebuilt in every rank from a picklable
factory with a fixed seed. 2 ranks by default (every rank imports mace, which is slow
on a small CPU box); ``pytest --mlipdd-world-sizes=2,3,4`` runs the full matrix.
"""

from __future__ import annotations

import functools

import torch

from mlipdd.testing import conformance_suite
from mlipdd_mace.testing import random_mace_wrapper

SPECIES = (1, 6, 8)
# The full matrix (`make test`); `pytest --mlipdd-world-sizes=2` for a quick local run.
WORLD_SIZES = (2, 3, 4)
FACTORY = functools.partial(
    random_mace_wrapper, elements=SPECIES, r_max=4.0, dtype=torch.float64, seed=0
)

# spacing 2.5 A with r_max 4 A: ~15 neighbours per atom, two layers reach 8 A.
test_mace_conformance = conformance_suite(
    FACTORY, species=SPECIES, spacing=2.5, world_sizes=WORLD_SIZES, config_kwargs={"strategy": "halo"}
)

# Sharded storage (MACE's preferred strategy on several ranks, what DomainConfig() picks
# by default): each rank keeps only its owned rows (no ghost shell); mace's reads of
# remote senders (node features, positions, system index) are routed to their owners. At 3
# ranks a rank owns no atom of these cells: mace runs on its zero rows.
test_mace_conformance_sharded = conformance_suite(
    FACTORY, species=SPECIES, spacing=2.5, world_sizes=WORLD_SIZES, config_kwargs={"strategy": "sharded"}
)
