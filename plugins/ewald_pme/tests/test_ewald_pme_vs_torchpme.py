"""Single process: the wrappers against outside codes (torch-pme; nvalchemiops for DSF).

Ewald must equal torch-pme's Ewald to ~1e-10 at converged settings (both are then the
exact Ewald sum of the same charges), neutral and charged, in a tilted cell. PME must
approach Ewald as the mesh is refined, and match torch-pme's PME to mesh accuracy.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from mlipdd_ewald_pme.coulomb import COULOMB_EV_ANGSTROM
from mlipdd_ewald_pme.testing import rock_salt, torchpme_reference
from mlipdd_ewald_pme.wrappers import DSFWrapper, EwaldWrapper, PMEWrapper

pytest.importorskip("torchpme", reason="torch-pme is the outside oracle (requirements/ewald-pme.txt)")
CUTOFF = 8.0


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("extra_charge", [0.0, 3.0], ids=["neutral", "charged"])
def test_ewald_equals_torchpme(extra_charge):
    batch = rock_salt((2, 2, 2), vacancies=2, extra_charge=extra_charge)
    model = EwaldWrapper(cutoff=CUTOFF, accuracy=1e-10)
    out = model(batch, compute_stress=True)
    # torch-pme sums a box of k-vectors, not a sphere: give it a larger one to converge
    ref = torchpme_reference(batch, model.alpha, CUTOFF, "ewald", k_cutoff=2 * model.k_cutoff)
    assert _rel(out["energy"][0], ref["energy"]) < 1e-10
    assert _rel(out["forces"], ref["forces"]) < 1e-9
    assert _rel(out["stress"][0], ref["stress"]) < 1e-9


def test_pme_converges_to_ewald_and_matches_torchpme():
    batch = rock_salt((2, 2, 2), vacancies=2, extra_charge=1.0)
    ewald = EwaldWrapper(cutoff=CUTOFF, accuracy=1e-8)(batch, compute_stress=True)
    errors = []
    for spacing in (0.6, 0.45, 0.3):
        out = PMEWrapper(cutoff=CUTOFF, accuracy=1e-8, mesh_spacing=spacing)(batch, compute_stress=True)
        errors.append([_rel(out[k], ewald[k]) for k in ("energy", "forces", "stress")])
    assert errors[-1][0] < 1e-8 and errors[-1][1] < 1e-5 and errors[-1][2] < 1e-7, errors
    assert all(a[1] > b[1] for a, b in itertools.pairwise(errors)), f"no mesh convergence: {errors}"
    model = PMEWrapper(cutoff=CUTOFF, accuracy=1e-8, mesh_spacing=0.3)
    ref = torchpme_reference(batch, model.alpha, CUTOFF, "pme", mesh_spacing=0.2, interpolation_nodes=6)
    out = model(batch, compute_stress=True)
    assert _rel(out["energy"][0], ref["energy"]) < 1e-7
    assert _rel(out["forces"], ref["forces"]) < 1e-4


def test_dsf_matches_nvalchemiops_periodic_and_open():
    from mlipdd.neighbors import build_neighbor_list
    from nvalchemiops.torch.interactions.electrostatics import dsf_coulomb

    for pbc in (True, False):
        batch = rock_salt((2, 2, 2), vacancies=2)
        batch.system["pbc"] = torch.tensor([[pbc] * 3])
        model = DSFWrapper(cutoff=9.0, alpha=0.2)
        out = model(batch, compute_stress=pbc)
        nl = build_neighbor_list(batch, 9.0)
        order = torch.argsort(nl.edge_index[0], stable=True)
        edges, shifts = nl.edge_index[:, order], nl.unit_shifts[order]
        ptr = torch.zeros(batch.num_atoms + 1, dtype=torch.int32)
        ptr[1:] = torch.cumsum(torch.bincount(edges[0], minlength=batch.num_atoms), 0)
        energy, forces, *_ = dsf_coulomb(batch.positions, batch.charges, 9.0, 0.2, cell=batch.cell if pbc else None,
                                         neighbor_list=edges.int(), neighbor_ptr=ptr,
                                         unit_shifts=shifts.int() if pbc else None, compute_forces=True)
        # nvalchemiops evaluates erfc with a ~1e-7 approximation in its Warp kernel
        assert _rel(out["energy"], COULOMB_EV_ANGSTROM * energy) < 2e-6
        assert _rel(out["forces"], COULOMB_EV_ANGSTROM * forces) < 2e-6
