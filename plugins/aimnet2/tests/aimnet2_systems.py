"""The systems the AIMNet2 tests run on: small molecular crystals (methanol-like molecules)."""

from __future__ import annotations

import torch
from mlipdd.data import Batch
from mlipdd_aimnet2.testing import charged_pair, molecular_crystal

DSF_CUTOFF = 7.0  # longer than the network's 5 A, so the Coulomb matrix is a list of its own


def triclinic_crystal() -> Batch:
    """72 atoms, 12 molecules, triclinic cell (angles ~75-80 deg), neutral."""
    return Batch.from_data_list([molecular_crystal((3, 2, 2), seed=0)])


def slab() -> Batch:
    """Periodic in x and y, 10 A of vacuum along a non-periodic z; total charge -1."""
    return Batch.from_data_list([molecular_crystal((3, 2, 2), seed=3, vacuum_axis=2, charge=-1.0)])


def own_images() -> Batch:
    """Two molecules in a cell thinner than the cutoff: every rank sees its own images."""
    return Batch.from_data_list([molecular_crystal((2, 1, 1), seed=4)])


SYSTEMS = {
    "triclinic_crystal": triclinic_crystal,
    "slab": slab,
    "two_charged_systems": charged_pair,
    "own_images": own_images,
}


def total_charges(batch: Batch) -> torch.Tensor:
    if batch.charge is None:
        return torch.zeros(batch.num_systems, dtype=batch.dtype)
    return batch.charge.reshape(-1)
