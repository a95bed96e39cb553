"""D3(BJ)-ATM: the three-body term against simple-dftd3 (22 crystals, metals, an oxide slab,
an open MgO cluster, molecules; energies, forces, stress) and tad-dftd3 (molecules and the
cluster: its ATM is dense in the atoms, so the periodic image clusters are out of reach);
a three-body cutoff shorter than the pair one; and D3Wrapper's switch against aimnet's own
D3 (15 A cutoff, 12-15 A switch, as the released AIMNet2 models use) and simple-dftd3's
pair smoothing (the same quintic)."""

from __future__ import annotations

import pytest
import torch
from mlipdd import Batch
from mlipdd_ewald_pme.d3 import PBE_BJ, D3Wrapper
from mlipdd_ewald_pme.testing import d3_systems, simple_dftd3_reference, tad_dftd3_reference

pytest.importorskip("dftd3", reason="simple-dftd3's Python API (requirements/ewald-pme-upstream.txt)")
CUTOFF = 6.0
SYSTEMS = d3_systems()
OPEN = [name for name, atoms in SYSTEMS.items() if not atoms.pbc.any()]
ATM = {**PBE_BJ, "s9": 1.0}


def _rel(a, b) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def results():
    model, pair_only = D3Wrapper(cutoff=CUTOFF, params=ATM), D3Wrapper(cutoff=CUTOFF)
    out = {}
    for name, atoms in SYSTEMS.items():
        batch = Batch.from_ase(atoms)
        periodic = bool(atoms.pbc.all())
        out[name] = (batch, model(batch, compute_stress=periodic), pair_only(batch)["energy"].detach())
    return out


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_atm_equals_simple_dftd3(results, name):
    batch, out, pair_energy = results[name]
    ref = simple_dftd3_reference(batch, CUTOFF, PBE_BJ, s9=1.0)
    ref_pair = simple_dftd3_reference(batch, CUTOFF, PBE_BJ, s9=0.0)
    three, ref_three = out["energy"][0] - pair_energy[0], ref["energy"] - ref_pair["energy"]
    assert float(ref_three) > 0, name  # ATM is repulsive for these: a real three-body term
    # measured: total energy <= 3e-8, forces <= 4e-7, stress <= 2e-8 relative (the pair term's
    # own distance to simple-dftd3); the three-body part alone <= 1e-6 relative
    assert _rel(three, ref_three) < 5e-6, (name, float(three), float(ref_three))
    assert _rel(out["energy"][0], ref["energy"]) < 1e-7
    assert _rel(out["forces"], ref["forces"]) < 1e-6
    if "stress" in out:
        assert _rel(out["stress"][0], ref["stress"]) < 1e-7


@pytest.mark.parametrize("name", OPEN)
def test_atm_equals_tad_dftd3(results, name):
    batch, out, _ = results[name]
    ref = tad_dftd3_reference(batch, CUTOFF, PBE_BJ, s9=1.0)
    assert not ref["finite_differences"]
    assert _rel(out["energy"][0], ref["energy"]) < 1e-12
    assert _rel(out["forces"], ref["forces"]) < 1e-10


def test_three_body_cutoff_shorter_than_the_pairs():
    batch = Batch.from_ase(SYSTEMS["Al2O3 corundum"])
    out = D3Wrapper(cutoff=CUTOFF, params=ATM, three_body_cutoff=4.0)(batch, compute_stress=True)
    ref = simple_dftd3_reference(batch, CUTOFF, PBE_BJ, s9=1.0, three_body_cutoff=4.0)
    full = simple_dftd3_reference(batch, CUTOFF, PBE_BJ, s9=1.0)
    assert _rel(full["energy"], ref["energy"]) > 1e-5  # the shorter cutoff drops real triples
    assert _rel(out["energy"][0], ref["energy"]) < 1e-7
    assert _rel(out["forces"], ref["forces"]) < 1e-6
    assert _rel(out["stress"][0], ref["stress"]) < 1e-7


def test_switch_equals_aimnets_d3():
    """aimnet's `DFTD3` (nvalchemiops kernels, float32 tables) with the released models'
    15 A cutoff and 12-15 A switch, on a 216-atom molecular cluster 23 A across."""
    from aimnet.modules.lr import DFTD3
    from mlipdd_aimnet2.building import released_layout
    from mlipdd_aimnet2.testing import molecular_crystal

    params = released_layout()[1]["d3_params"]
    batch = Batch.from_data_list([molecular_crystal((4, 3, 3), seed=5, pbc=False)])
    assert float(torch.pdist(batch.positions).max()) > 20.0  # pairs on both sides of the window
    positions = batch.positions.clone().requires_grad_(True)
    module = DFTD3(s8=params["s8"], a1=params["a1"], a2=params["a2"], s6=params["s6"], cutoff=15.0,
                   smoothing_fraction=0.2)
    energy = module({"coord": positions[None], "numbers": batch.atomic_numbers[None],
                     "_nb_mode": torch.tensor(0)})["energy"].sum()
    forces = -torch.autograd.grad(energy, positions)[0]
    switched = D3Wrapper(cutoff=15.0, params=params, switch_on=12.0)(batch)
    hard = D3Wrapper(cutoff=15.0, params=params)(batch)
    # measured: 6e-8 (energy), 7e-6 (forces) relative: aimnet's float32 tables; hard cutoff 1e-4, 6e-4
    assert _rel(switched["energy"][0], energy) < 1e-6
    assert _rel(switched["forces"], forces) < 2e-5
    assert _rel(hard["energy"][0], energy) > 3e-5 and _rel(hard["forces"], forces) > 2e-4


@pytest.mark.parametrize("name", ["Al2O3 corundum", "MgO rock salt", "Cu fcc (cubic)", "MgO(100) slab", "MgO cluster (open)"])
def test_switch_equals_simple_dftd3s_smoothing(name):
    """simple-dftd3's pair smoothing (``width2``) is the same quintic over the last part of
    the cutoff: D3Wrapper(cutoff=8, switch_on=6) equals it with a 2 A width."""
    batch = Batch.from_ase(SYSTEMS[name])
    periodic = bool(SYSTEMS[name].pbc.all())
    out = D3Wrapper(cutoff=8.0, switch_on=6.0)(batch, compute_stress=periodic)
    ref = simple_dftd3_reference(batch, 8.0, PBE_BJ, switch_width=2.0)
    hard = simple_dftd3_reference(batch, 8.0, PBE_BJ)
    assert _rel(hard["energy"], ref["energy"]) > 1e-4  # the window holds real pairs
    assert _rel(out["energy"][0], ref["energy"]) < 1e-8
    assert _rel(out["forces"], ref["forces"]) < 1e-6
    if periodic:
        assert _rel(out["stress"][0], ref["stress"]) < 1e-7


def test_switch_forces_are_the_energy_gradient():
    """Inside the window the switch's own derivative enters the forces: central differences."""
    batch = Batch.from_ase(SYSTEMS["benzene"])
    model = D3Wrapper(cutoff=4.0, switch_on=2.0)  # most C-H and H-H pairs inside the window
    forces = model(batch)["forces"]
    h = 1e-5
    for atom, axis in ((0, 0), (7, 2)):
        shifted = []
        for sign in (1, -1):
            moved = batch.clone()
            moved.node["positions"] = batch.positions.clone()
            moved.node["positions"][atom, axis] += sign * h
            shifted.append(float(model(moved)["energy"][0].detach()))
        assert abs(-(shifted[0] - shifted[1]) / (2 * h) - float(forces[atom, axis])) < 1e-7


def test_bad_three_body_and_switch_options():
    from mlipdd.data import InputError

    with pytest.raises(InputError, match="three_body_cutoff"):
        D3Wrapper(cutoff=6.0, three_body_cutoff=8.0)
    with pytest.raises(InputError, match="switch_on"):
        D3Wrapper(cutoff=6.0, switch_on=6.0)
