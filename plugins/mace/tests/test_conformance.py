"""Multi-rank conformance: distributed MACE equals single-process MACE.

Driven by the core's kit (`mlipdd.testing.conformance.check_conformance`), which
builds the model in every spawned gloo rank from a picklable factory. Skips until the
kit and the distributed runtime are in the core. 2 ranks by default; set
``MLIPDD_CONFORMANCE_RANKS=2,3,4`` for the full matrix of ARCHITECTURE.md (slow on CPU:
every rank imports mace).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from mlipdd.data import Batch
from mlipdd_mace.testing import random_mace_wrapper

from conftest import STRUCTURES

conformance = pytest.importorskip(
    "mlipdd.testing.conformance", reason="core conformance kit not installed yet"
)
distributed = pytest.importorskip(
    "mlipdd.distributed", reason="core distributed runtime not installed yet"
)
if not hasattr(distributed, "DistributedModel"):
    pytest.skip("mlipdd.distributed.DistributedModel has not landed yet", allow_module_level=True)

RANKS = [int(n) for n in os.environ.get("MLIPDD_CONFORMANCE_RANKS", "2").split(",")]
FACTORY = functools.partial(
    random_mace_wrapper, elements=(1, 6, 8), r_max=4.0, dtype=torch.float64, seed=0
)


def _replicated(atoms, reps):
    return atoms.repeat(reps)


@pytest.mark.parametrize("world_size", RANKS)
@pytest.mark.parametrize(
    "name,reps",
    [("triclinic", (2, 2, 1)), ("tiny_cell", (2, 1, 1)), ("slab", (2, 2, 1))],
)
def test_distributed_equals_single_process(name, reps, world_size):
    batch = Batch.from_ase(_replicated(STRUCTURES[name](), reps))
    result = conformance.check_conformance(FACTORY, batch, world_size, compute_stress=True)
    result.assert_close(energy=1e-12, forces=1e-10, stress=1e-10)
