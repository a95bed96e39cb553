"""`MLIPDDCalculator`: ASE's own LJ, ASE optimisers and MD on 1 and N persistent ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS
from mlipdd.ase import MLIPDDCalculator
from mlipdd.data import InputError
from mlipdd.models import LennardJones
from mlipdd.testing import AWKWARD_CELLS, run_ranks

EPS, SIGMA, CUTOFF = 0.0104, 3.4, 8.5


def lj_model():
    return LennardJones(epsilon=EPS, sigma=SIGMA, cutoff=CUTOFF)


def argon_triclinic(rattle=0.15, seed=1) -> Atoms:
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((3, 3, 3))
    shear = np.array([[0.0, 0.0, 0.0], [1.6, 0.0, 0.0], [0.8, 1.1, 0.0]])
    atoms.set_cell(atoms.cell.array + shear, scale_atoms=True)
    atoms.rattle(rattle, seed=seed)
    return atoms


@pytest.fixture(scope="module")
def calc2():
    with MLIPDDCalculator(lj_model(), nproc=2) as calc:
        yield calc


def _relax(calc, steps=25):
    atoms = argon_triclinic()
    atoms.calc = calc
    opt = BFGS(atoms, logfile=None)
    opt.run(fmax=1e-3, steps=steps)
    return atoms.get_positions(), atoms.get_potential_energy(), opt.nsteps


def _verlet(calc, steps=30):
    atoms = argon_triclinic(rattle=0.05, seed=3)
    rng = np.random.default_rng(0)
    atoms.set_velocities(rng.normal(scale=0.004, size=(len(atoms), 3)))
    atoms.calc = calc
    VelocityVerlet(atoms, timestep=5.0 * 0.09822694788464063).run(steps)  # 5 fs in ASE units
    return atoms.get_positions(), atoms.get_velocities(), atoms.get_total_energy()


def test_one_process_equals_ase_lennard_jones():
    """Outside check: ASE's LennardJones(smooth=False) is the same shifted potential."""
    atoms = argon_triclinic()
    ref = atoms.copy()
    ref.calc = AseLennardJones(epsilon=EPS, sigma=SIGMA, rc=CUTOFF, smooth=False)
    atoms.calc = MLIPDDCalculator(lj_model())
    assert abs(atoms.get_potential_energy() - ref.get_potential_energy()) < 1e-10
    np.testing.assert_allclose(atoms.get_forces(), ref.get_forces(), atol=1e-12)
    np.testing.assert_allclose(atoms.get_stress(), ref.get_stress(), atol=1e-12)


def test_bfgs_and_verlet_on_two_ranks_equal_one_process(calc2):
    pids = calc2.worker_pids
    one = MLIPDDCalculator(lj_model(), nproc=1)
    pos1, e1, n1 = _relax(one)
    pos2, e2, n2 = _relax(calc2)
    assert n1 == n2 and n1 > 5
    assert abs(e1 - e2) < 1e-10 * abs(e1)
    np.testing.assert_allclose(pos2, pos1, atol=1e-9)

    v_pos1, vel1, etot1 = _verlet(one)
    v_pos2, vel2, etot2 = _verlet(calc2)
    np.testing.assert_allclose(v_pos2, v_pos1, atol=1e-9)
    np.testing.assert_allclose(vel2, vel1, atol=1e-11)
    assert abs(etot2 - etot1) < 1e-9
    assert calc2.worker_pids == pids  # the same ranks served every call


def _distributed_model_outputs(rank, world_size, batch):
    from mlipdd.distributed import DistributedModel, DomainConfig, gather_rows

    dm = DistributedModel(lj_model(), DomainConfig(cutoff=CUTOFF))
    owned = dm.partition(batch if rank == 0 else None)
    out = dm(owned, compute_stress=True)
    forces = gather_rows(owned.atom_ids, out["forces"])
    return None if rank else (out["energy"], forces, out["stress"])


def test_calculator_equals_distributed_model(calc2):
    from mlipdd.data import AtomicData

    atoms = argon_triclinic(seed=7)
    atoms.calc = calc2
    energy, forces, stress = run_ranks(_distributed_model_outputs, 2, AtomicData.from_ase(atoms))[0]
    assert atoms.get_potential_energy() == pytest.approx(float(energy[0]), rel=1e-14, abs=1e-14)
    np.testing.assert_allclose(atoms.get_forces(), forces.numpy(), rtol=0, atol=1e-14)
    s = stress[0].numpy()
    np.testing.assert_allclose(atoms.get_stress(), s[[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]], atol=1e-14)


def test_bad_input_raises_and_the_ranks_keep_serving(calc2):
    atoms = argon_triclinic()
    atoms.positions[3] = np.nan
    atoms.calc = calc2
    with pytest.raises(InputError, match="NaN"):
        atoms.get_forces()
    good = argon_triclinic()
    good.calc = calc2
    assert np.isfinite(good.get_forces()).all()


@pytest.mark.parametrize("nproc", [3, 4])
def test_awkward_cells_on_three_and_four_ranks(nproc):
    """Periodic triclinic, a cell whose ranks see their own images, a slab with vacuum."""
    cells = {name: AWKWARD_CELLS[name]().to_ase()[0] for name in ("triclinic", "small_cell", "slab")}
    one = MLIPDDCalculator(lj_model())
    with MLIPDDCalculator(lj_model(), nproc=nproc) as calc:
        for name, atoms in cells.items():
            ref = atoms.copy()
            ref.calc, atoms.calc = one, calc
            props = ("energy", "forces", "stress") if atoms.pbc.all() else ("energy", "forces")
            for prop in props:
                expected = ref.get_properties([prop])[prop]
                got = atoms.get_properties([prop])[prop]
                scale = max(1.0, float(np.abs(expected).max()))
                assert np.abs(got - expected).max() < 1e-10 * scale, (name, prop)


def test_close_stops_the_ranks():
    calc = MLIPDDCalculator(lj_model(), nproc=2)
    pids = calc.worker_pids
    calc.close()
    calc.close()  # twice is fine
    assert not any(_alive(pid) for pid in pids)


_ORPHAN_SCRIPT = """
import os, signal
from mlipdd.ase import MLIPDDCalculator
from mlipdd.models import LennardJones
if __name__ == "__main__":
    calc = MLIPDDCalculator(LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.5), nproc=2)
    print(*calc.worker_pids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no finally: the ranks must still go
"""


def test_ranks_die_with_their_parent(tmp_path):
    script = tmp_path / "killed_parent.py"
    script.write_text(_ORPHAN_SCRIPT)
    # a user's shell: not the session's preload list (its packages print banners, e.g. Warp's)
    env = {k: v for k, v in os.environ.items() if k != "MLIPDD_SPAWN_PRELOAD"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False, timeout=300,
                         env=env)
    pids = [int(p) for p in out.stdout.split() if p.isdigit()]
    assert len(pids) == 2, out.stderr
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "ranks outlived their parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")


def test_requires_positive_nproc():
    with pytest.raises(ValueError, match="nproc"):
        MLIPDDCalculator(lj_model(), nproc=0)


def test_stress_needs_a_cell_periodic_in_two_directions():
    from ase.calculators.calculator import PropertyNotImplementedError

    atoms = AWKWARD_CELLS["slab"]().to_ase()[0]
    atoms.pbc = [True, False, False]  # a wire: no stress, as for a cluster
    atoms.calc = MLIPDDCalculator(lj_model())
    assert np.isfinite(atoms.get_forces()).all()
    with pytest.raises(PropertyNotImplementedError, match="periodic"):
        atoms.get_stress()
    assert torch.get_default_dtype() == torch.float32  # the calculator changed nothing global


def qeq_model():
    from mlipdd.testing.qeq_model import QEqModel

    return QEqModel(cutoff=4.5, species=(1, 8))


def test_charges_of_a_charge_model_on_two_sharded_ranks():
    """A charge-equilibration model: ASE gets its charges, on 2 ranks as on one process."""
    from mlipdd.distributed import DomainConfig, StrategyKind
    from mlipdd.testing.systems import triclinic

    atoms = triclinic(species=(1, 8), spacing=3.0).to_ase()[0]
    ref = atoms.copy()
    ref.calc = MLIPDDCalculator(qeq_model())
    config = DomainConfig(cutoff=4.5, strategy=StrategyKind.SHARDED)
    with MLIPDDCalculator(qeq_model, nproc=2, config=config) as calc:  # a factory: each rank builds it
        atoms.calc = calc
        charges = atoms.get_charges()
        np.testing.assert_allclose(charges, ref.get_charges(), rtol=0, atol=1e-12)
        np.testing.assert_allclose(atoms.get_forces(), ref.get_forces(), rtol=0, atol=1e-10)
    assert abs(charges.sum()) < 1e-10 and np.abs(charges).max() > 1e-3  # neutral, not all zero


def test_calculators_sharing_a_pool_use_its_ranks_and_settings():
    from mlipdd.ase import RankPool

    with RankPool(lj_model(), nproc=2) as pool:
        calcs = [MLIPDDCalculator(pool=pool) for _ in range(3)]
        assert all(c.worker_pids == pool.pids for c in calcs) and len(pool.pids) == 2
        one = MLIPDDCalculator(lj_model())
        for seed, calc in enumerate(calcs):
            atoms, ref = argon_triclinic(seed=seed), argon_triclinic(seed=seed)
            atoms.calc, ref.calc = calc, one
            assert atoms.get_potential_energy() == pytest.approx(ref.get_potential_energy(), rel=1e-12)
        calcs[0].close()  # a calculator does not close the pool it was given
        assert pool.alive
        with pytest.raises(ValueError, match="give dtype to RankPool"):
            MLIPDDCalculator(pool=pool, dtype=torch.float32)
        pids = pool.pids
    assert not any(_alive(pid) for pid in pids)  # closing the pool stops them
