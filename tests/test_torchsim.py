"""`mlipdd.torchsim.TorchSimModel`: torch-sim's integrators and optimisers drive an mlipdd
model; outputs equal the plain model's and torch-sim's own MaceModel, and 2 ranks equal one
process. Runs on torch-sim 0.3 (what pip resolves on Python < 3.12) and 0.6 (Python >= 3.12)."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch_sim as ts  # the `torchsim` extra (also in the `test` extra)
from mlipdd.models import LennardJones
from mlipdd.testing.systems import two_systems
from mlipdd.torchsim import TorchSimModel, batch_from_state

CPU = torch.device("cpu")
# torch-sim 0.4 replaced the integrator/optimiser functions by enums (ts.Integrator.nve, ...)
ENUM_API = hasattr(ts, "Integrator")


def integrator(name: str):
    return getattr(ts.Integrator, name) if ENUM_API else getattr(ts, name)


def unit_cell_fire() -> dict:
    """`ts.optimize` keywords of FIRE with unit-cell relaxation, in the installed API."""
    if ENUM_API:
        return {"optimizer": ts.Optimizer.fire, "init_kwargs": {"cell_filter": ts.CellFilter.unit}}
    return {"optimizer": ts.unit_cell_fire}


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
    final = ts.integrate(system=state, model=model, integrator=integrator("nve"), n_steps=100,
                         temperature=60.0, timestep=0.004)  # ps
    kinetic = ts.calc_kinetic_energy(masses=final.masses, momenta=final.momenta)
    start = ts.integrate(system=state, model=model, integrator=integrator("nve"), n_steps=1,
                         temperature=60.0, timestep=0.004)
    e_start = start.energy + ts.calc_kinetic_energy(masses=start.masses, momenta=start.momenta)
    e_end = final.energy + kinetic
    assert float(kinetic) > 0.0
    assert abs(float(e_end - e_start)) < 2e-3 * abs(float(e_start)), (e_start, e_end)

    relaxed = ts.optimize(system=state, model=model, max_steps=300, **unit_cell_fire(),
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
            runs[nproc] = ts.integrate(system=state, model=model, integrator=integrator("nvt_langevin"),
                                       n_steps=25, temperature=90.0, timestep=0.004)
        finally:
            model.close()
    torch.testing.assert_close(runs[2].positions, runs[1].positions, rtol=0, atol=1e-9)
    torch.testing.assert_close(runs[2].momenta, runs[1].momenta, rtol=0, atol=1e-9)


def test_equals_torch_sims_own_mace_model():
    from mlipdd_mace.testing import random_mace
    from mlipdd_mace.wrapper import MACEWrapper
    from torch_sim.models.mace import MaceModel

    mace = random_mace(elements=(8, 18), r_max=4.0, dtype=torch.float64, seed=3)
    atoms = two_systems(species=(18, 8), spacing=2.6).to_ase()
    state = ts.initialize_state(atoms, device=CPU, dtype=torch.float64)
    theirs = MaceModel(mace, device=CPU, dtype=torch.float64)(state)
    for nproc in (1, 2):
        model = TorchSimModel(MACEWrapper(mace), nproc=nproc)
        try:
            ours = model(state)
        finally:
            model.close()
        for key in ("energy", "forces", "stress"):
            scale = float(theirs[key].abs().max())
            torch.testing.assert_close(ours[key], theirs[key].detach(), rtol=0, atol=1e-12 * scale)


def test_without_torch_sim_the_import_error_names_the_extra():
    # sys.modules[name] = None is Python's own way to make `import name` fail as if absent
    code = ("import sys; sys.modules['torch_sim'] = None\n"
            "try:\n    from mlipdd.torchsim import TorchSimModel\n"
            "except ImportError as error:\n    print(type(error).__name__, error)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("ImportError mlipdd.torchsim needs torch-sim (torch-sim-atomistic): "
                                  "pip install 'mlipdd[torchsim]'"), out.stdout + out.stderr


def docstring_examples() -> list[str]:
    """The code blocks of mlipdd.torchsim's docstring (the lines indented by four spaces)."""
    import mlipdd.torchsim

    blocks, current = [], []
    for line in mlipdd.torchsim.__doc__.splitlines() + [""]:
        if line.startswith("    "):
            current.append(line[4:])
        elif current and line.strip() == "":
            continue
        elif current:
            blocks.append("\n".join(current))
            current = []
    return blocks


def test_the_module_docstring_example_runs_on_the_installed_torch_sim():
    """Was: the docstring used an API torch-sim no longer has (issue 24 item 7). Its first
    block is torch-sim >= 0.4's (tox -e torchsim-py312 runs it, on 0.6), the second
    replaces the runner calls by 0.3's (this suite on Python 3.11)."""
    first, older = docstring_examples()[:2]
    if not ENUM_API:
        setup = first[: first.index("final = ")]
        code = setup + older
    else:
        code = first
    namespace: dict = {}
    exec(compile(code, "mlipdd.torchsim docstring", "exec"), namespace)  # noqa: S102 - our own text
    state, final, relaxed = namespace["state"], namespace["final"], namespace["relaxed"]
    assert float((final.positions - state.positions).abs().max()) > 1e-4  # it moved
    energy = lj_model()(batch_from_state(relaxed, torch.float64))["energy"]
    assert float(energy) < float(lj_model()(batch_from_state(state, torch.float64))["energy"])


def test_the_installed_torch_sim_is_the_one_the_extra_takes_on_this_python():
    """The suite tests what `pip install 'mlipdd[torchsim]'` gives a user of this Python:
    on 3.11 the newest release that installs there (0.3.0: 0.4.0-0.6.2 declare Requires-Python
    >= 3.12 and use its generic syntax, `def integrate[T: SimState]`), on >= 3.12 the
    current one (0.6)."""
    from importlib.metadata import version
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["torchsim"]
    here = [r for r in map(Requirement, extra) if r.marker is None or r.marker.evaluate()]
    assert len(here) == 1, extra
    installed = version("torch-sim-atomistic")
    assert here[0].specifier.contains(installed), (installed, str(here[0]))
    assert ENUM_API == (sys.version_info >= (3, 12)), (installed, sys.version)

