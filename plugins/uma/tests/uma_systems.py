"""Systems of the UMA plugin tests (float32; a uniquely named module, see conftest.py)."""

from __future__ import annotations

import torch
from mlipdd.testing.systems import triclinic, two_systems

SPECIES = (1, 6, 8)
SPACING = 2.5  # A between grid sites: ~15 neighbours within the 4 A cutoff


def triclinic_cell():
    """Periodic, angles far from 90 degrees, 64 atoms of H/C/O."""
    return triclinic(species=SPECIES, spacing=SPACING, reps=4).to(dtype=torch.float32)


def batch_of_two():
    """Two periodic systems of different cells and sizes in one batch (189 atoms)."""
    return two_systems(species=SPECIES, spacing=SPACING).to(dtype=torch.float32)


SYSTEMS = {"triclinic": triclinic_cell, "two_systems": batch_of_two}
