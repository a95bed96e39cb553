"""`mlipdd.torchsim.TorchSimModel`: torch-sim's integrators and optimisers drive an mlipdd
model; outputs equal the plain model's, and 2 ranks equal one process."""

from __future__ import annotations

import torch
import torch_sim as ts  # the `torchsim` extra (also in the `test` extra)
from mlipdd.models import LennardJones
from mlipdd.testing.systems import two_systems
from mlipdd.torchsim import TorchSimModel, batch_from_state

CPU = torch.device("cpu")


def lj_model():
    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.5)


def argon_atoms():
    return two_systems(species=(18,), spacing=3.7).to_ase()  # two triclinic/cubic periodic cells


def test_outputs_equal_the_plain_model_on_a_batch_of_two_cells():
    atoms = argon_atoms()
    state = ts.initialize_state(atoms, device=CPU, dtype=torch.float64)
    out = TorchSimModel(lj_model())(state)
    batch = two_systems(species=(18,), spacing=3.7)
    plain = lj_model()(batch, compute_stress=True)
    assert out["energy"].shape == (2,) and out["stress"].shape == (2, 3, 3)
    for key in ("energy", "forces", "stress"):
        torch.testing.assert_close(out[key], plain[key].detach(), rtol=1e-13, atol=1e-14)
    # the state's column-vector cell arrives as mlipdd's row-vector cell
    torch.testing.assert_close(batch_from_state(state, torch.float64).cell, batch.cell)


def test_nve_conserves_energy_and_fire_relaxes():
    model = TorchSimModel(lj_model())
    atoms = argon_atoms()[0]
    state = ts.initialize_state(atoms, device=CPU, dtype=torch.float64)
    final = ts.integrate(system=state, model=model, integrator=ts.nve, n_steps=100,
                         temperature=60.0, timestep=0.004)  # ps
    kinetic = ts.calc_kinetic_energy(masses=final.masses, momenta=final.momenta)
    start = ts.integrate(system=state, model=model, integrator=ts.nve, n_steps=1,
                         temperature=60.0, timestep=0.004)
    e_start = start.energy + ts.calc_kinetic_energy(masses=start.masses, momenta=start.momenta)
    e_end = final.energy + kinetic
    assert float(kinetic) > 0.0
    assert abs(float(e_end - e_start)) < 2e-3 * abs(float(e_start)), (e_start, e_end)

    relaxed = ts.optimize(system=state, model=model, optimizer=ts.unit_cell_fire, max_steps=300,
                          convergence_fn=ts.generate_force_convergence_fn(force_tol=0.01))
    forces = lj_model()(batch_from_state(relaxed, torch.float64))["forces"]  # the plain model
    assert float(forces.norm(dim=1).max()) < 0.01


def test_two_ranks_drive_the_same_trajectory():
    atoms = argon_atoms()[0]
    state = ts.initialize_state(atoms, device=CPU, dtype=torch.float64)
    runs = {}
    for nproc in (1, 2):
        model = TorchSimModel(lj_model(), nproc=nproc)
        try:
            torch.manual_seed(0)  # nvt_langevin draws its noise from torch's generator
            runs[nproc] = ts.integrate(system=state, model=model, integrator=ts.nvt_langevin,
                                       n_steps=25, temperature=90.0, timestep=0.004)
        finally:
            model.close()
    torch.testing.assert_close(runs[2].positions, runs[1].positions, rtol=0, atol=1e-9)
    torch.testing.assert_close(runs[2].momenta, runs[1].momenta, rtol=0, atol=1e-9)
