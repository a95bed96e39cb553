"""Fixtures of the MACE plugin tests (data and helpers live in mace_structures.py)."""

from __future__ import annotations

import pytest
import torch
from ase import Atoms

pytest.importorskip("mace", reason="mace-torch is not installed (see plugins/mace/README.md)")

from mace_structures import ELEMENTS, R_MAX, STRUCTURES

from mlipdd.testing.spawn import preload_in_forkserver
from mlipdd_mace.testing import random_mace

# spawned ranks import mace once, in this process's forkserver, instead of once per rank
preload_in_forkserver("mace.modules")


@pytest.fixture(scope="session")
def mace_model():
    return random_mace(elements=ELEMENTS, r_max=R_MAX, dtype=torch.float64, seed=0)


@pytest.fixture(params=sorted(STRUCTURES))
def structure(request) -> Atoms:
    return STRUCTURES[request.param]()


