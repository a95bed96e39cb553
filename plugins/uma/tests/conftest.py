"""Shared settings and systems for the UMA plugin tests.

Models are tiny (8 channels, lmax 1, 2 layers, 4 A) and systems have tens to a couple
of hundred atoms: the suite runs on a shared 2-core machine. Everything is float32.
"""

from __future__ import annotations

import os

# before anything imports huggingface_hub: the offline test must fail at once, not retry
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# spawned ranks import fairchem once, in the forkserver, instead of once per rank
_preload = "fairchem.core.models.uma.escn_md,mlipdd_uma.wrapper"
os.environ["MLIPDD_SPAWN_PRELOAD"] = ",".join(
    p for p in (os.environ.get("MLIPDD_SPAWN_PRELOAD", ""), _preload) if p
)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("fairchem.core", reason="fairchem-core is not installed (see plugins/uma/README.md)")

from mlipdd.testing.systems import triclinic, two_systems  # noqa: E402

SPECIES = (1, 6, 8)
SPACING = 2.5  # A between grid sites: ~15 neighbours within the 4 A cutoff


def triclinic_cell():
    """Periodic, angles far from 90 degrees, 64 atoms of H/C/O."""
    return triclinic(species=SPECIES, spacing=SPACING, reps=4).to(dtype=torch.float32)


def batch_of_two():
    """Two periodic systems of different cells and sizes in one batch (189 atoms)."""
    return two_systems(species=SPECIES, spacing=SPACING).to(dtype=torch.float32)


SYSTEMS = {"triclinic": triclinic_cell, "two_systems": batch_of_two}
