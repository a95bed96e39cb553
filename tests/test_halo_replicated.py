"""Per-system values used inside the forward, under HALO storage (NOTE [replicated gradients]).

Charge equilibration computes a Lagrange multiplier per system (a sum over all atoms)
and feeds it back into per-atom charges; each rank's backward then holds only its share
of dE/d(multiplier). These tests fail if that share is not summed over ranks.
"""

import pytest
import torch
from mlipdd.spec.presets import SPEC_MPNN_HALO
from mlipdd.testing.conformance import check_conformance
from mlipdd.testing.qeq_model import QEqModel
from mlipdd.testing.systems import small_cell, triclinic, two_systems

SPECIES = (1, 8)


def qeq():
    return QEqModel(cutoff=4.5, species=SPECIES)


def charged_pair():
    batch = two_systems(species=SPECIES, spacing=3.0)
    batch.system["charge"] = torch.tensor([1.0, -2.0], dtype=torch.float64)
    return batch


SYSTEMS = {
    "triclinic": lambda: triclinic(species=SPECIES, spacing=3.0),
    "two_charged_systems": charged_pair,
    "own_images": lambda: small_cell(species=SPECIES, spacing=3.0),
}


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_charge_equilibration_under_halo_equals_one_process(system, world_size):
    result = check_conformance(qeq, SYSTEMS[system](), world_size, spec=SPEC_MPNN_HALO)
    result.assert_close(energy=1e-12, forces=1e-10, stress=1e-10)
