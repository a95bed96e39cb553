"""The ASE calculator's fault cases (issue 25 items 9 and 12): every call answers or raises
within seconds, and bad input or a failed call leaves the calculator serving the next one.
Real ranks (``nproc=2``, gloo) next to one process (``nproc=1``)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from calculator_models import ARGON, NaNAboveVolume
from mlipdd.ase import MLIPDDCalculator, WorkerError
from mlipdd.data import InputError
from mlipdd.models import LennardJones
from mlipdd.testing.faults import FailsInBackward

NPROCS = [1, 2]


def argon(repeat=3, seed=1) -> Atoms:
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(repeat)
    atoms.set_cell(atoms.cell.array + [[0, 0, 0], [1.1, 0, 0], [0.5, 0.7, 0]], scale_atoms=True)
    atoms.rattle(0.1, seed=seed)
    return atoms


def one_atom(periodic: bool) -> Atoms:
    return Atoms("Ar", positions=[[4.0, 5.0, 6.0]], cell=[10.0, 11.0, 12.0], pbc=periodic)


def lone_atom_and_pair() -> Atoms:
    """Two atoms near one wall and one far off: along the cut, one rank owns a lone atom."""
    return Atoms("Ar3", positions=[[1.0, 5, 5], [4.5, 5, 5], [18.0, 5, 5]], cell=[20, 10, 10], pbc=False)


def _props(atoms, calc):
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms.get_potential_energy(), atoms.get_forces()


@pytest.fixture(scope="module")
def one():
    return MLIPDDCalculator(LennardJones(**ARGON))


@pytest.fixture(scope="module")
def two():
    with MLIPDDCalculator(LennardJones(**ARGON), nproc=2) as calc:
        yield calc


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_a_single_atom_and_a_lone_atom_answer_at_several_ranks(nproc, one):
    """Ranks with nothing to do (was broken: the call hung for the 300 s collective timeout)."""
    calc = MLIPDDCalculator(LennardJones(**ARGON), nproc=nproc)
    for atoms in (one_atom(False), one_atom(True), lone_atom_and_pair()):
        start = time.monotonic()
        energy, forces = _props(atoms, calc)
        assert time.monotonic() - start < 20
        ref_energy, ref_forces = _props(atoms, one)
        assert energy == pytest.approx(ref_energy, abs=1e-14)
        np.testing.assert_allclose(forces, ref_forces, atol=1e-14)
    calc.close()


def _bad_inputs() -> dict[str, Atoms]:
    nan = argon()
    nan.positions[5] = np.nan
    alien = argon()
    alien.numbers[4] = 200  # no such element
    return {"nan": nan, "alien": alien}


@pytest.mark.parametrize("nproc", NPROCS)
def test_bad_input_raises_in_the_caller_and_the_next_call_is_served(nproc, one, two):
    calc = one if nproc == 1 else two
    pids = calc.worker_pids
    good = argon(seed=4)
    expected = _props(good, one)
    for name, atoms in _bad_inputs().items():
        with pytest.raises(InputError):
            _props(atoms, calc)
        energy, forces = _props(good, calc)
        assert energy == pytest.approx(expected[0], rel=1e-12), name
        np.testing.assert_allclose(forces, expected[1], atol=1e-12)
    assert calc.worker_pids == pids  # the same ranks


def test_a_molecule_without_a_cell_runs_at_two_ranks_in_a_box_of_vacuum(one, two):
    """Issue 24 item 4: a box with vacuum is given (and said, once); energy and forces equal
    one process and ASE's atoms are untouched. Was broken: refused, and the refusal on rank 0
    killed the ranks for every later call."""
    import warnings

    pids = two.worker_pids
    molecule = Atoms("Ar3", positions=[[0, 0, 0], [3.7, 0, 0], [0, 3.8, 0.2]])
    before = molecule.positions.copy()
    molecule.calc = two
    with pytest.warns(UserWarning, match="no periodic box given"):
        energy, forces = molecule.get_potential_energy(), molecule.get_forces()
    np.testing.assert_array_equal(molecule.positions, before)  # the box is the ranks' business
    assert not molecule.cell.any()
    ref = _props(molecule, one)
    assert energy == pytest.approx(ref[0], abs=1e-14) and abs(energy) > 1e-4
    np.testing.assert_allclose(forces, ref[1], atol=1e-14)
    moved = molecule.copy()
    moved.positions[1, 0] += 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not at every call
        assert _props(moved, two)[0] == pytest.approx(_props(moved, one)[0], abs=1e-14)
    good = argon(seed=5)
    assert _props(good, two)[0] == pytest.approx(_props(good, one)[0], rel=1e-12)
    assert two.worker_pids == pids


@pytest.mark.parametrize("nproc", NPROCS)
def test_overlapping_atoms_are_named(nproc, one, two):
    """Distance 0 (was broken: NaN energy; at 2 ranks a message blaming a scatter rebind)."""
    calc = one if nproc == 1 else two
    atoms = argon()
    atoms.positions[7] = atoms.positions[3]
    with pytest.raises(InputError, match=r"atoms 3 and 7 overlap: 0 A apart"):
        _props(atoms, calc)
    image = argon()
    image.positions[9] = image.positions[2] + image.cell[0]  # the same site, one cell over
    with pytest.raises(InputError, match=r"atoms 2 and 9 \(a periodic image\) overlap"):
        _props(image, calc)
    assert np.isfinite(_props(argon(seed=6), calc)[1]).all()  # and it serves on


@pytest.mark.parametrize("nproc", NPROCS)
def test_a_non_finite_result_raises_at_every_call(nproc):
    """Every call is a new geometry (was broken: the ranks looked every 10th call, and NaN
    reached ASE in between)."""
    good = argon(repeat=2)
    volume = good.get_volume()
    with MLIPDDCalculator(NaNAboveVolume(volume * 1.01), nproc=nproc) as calc:
        assert np.isfinite(_props(good, calc)[1]).all()
        for stretch in (1.02, 1.03, 1.04):  # calls 2, 3, 4: between the ranks' own checks
            bad = good.copy()
            bad.set_cell(good.cell * stretch ** (1 / 3), scale_atoms=True)
            with pytest.raises(FloatingPointError, match=r"model returned a non-finite energy"):
                _props(bad, calc)
        assert np.isfinite(_props(good, calc)[1]).all()


def test_an_error_on_one_rank_is_named_and_the_same_ranks_serve_on():
    """A model error on rank 1 only (the others wait in a collective): the call raises it
    naming rank 1 within seconds; the ranks regroup and serve the next call."""
    atoms = argon(repeat=2)
    expected = _props(atoms, MLIPDDCalculator(LennardJones(**ARGON)))
    with MLIPDDCalculator(FailsInBackward(fail_rank=1, fail_call=2), nproc=2) as calc:
        pids = calc.worker_pids
        _props(atoms, calc)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank 1.*injected failure"):
            _props(argon(repeat=2, seed=2), calc)
        assert time.monotonic() - start < 20
        energy, forces = _props(atoms, calc)
        assert calc.worker_pids == pids
    assert energy == pytest.approx(expected[0], rel=1e-12)
    np.testing.assert_allclose(forces, expected[1], atol=1e-12)


def test_results_are_float64_numpy_for_a_float64_model(two):
    energy, forces = _props(argon(), two)
    assert isinstance(energy, float) and forces.dtype == np.float64
    assert torch.get_default_dtype() == torch.float32  # nothing global changed


@pytest.mark.parametrize("nproc", NPROCS)
def test_overlapping_atoms_are_named_by_mlipdd_run(tmp_path, monkeypatch, capfd, nproc):
    """The same check reaches the CLI (it lives in the input validation), exit 2, one line.
    `mlipdd.cli.main` in this process (at 2 ranks it starts real rank processes, which
    write to this process's stderr): a fresh launcher would only add a torch import
    (the launcher's own faults are tests/faults/test_fault_launcher.py)."""
    import ase.io
    from mlipdd.cli import main

    atoms = argon()
    atoms.positions[7] = atoms.positions[3]
    ase.io.write(tmp_path / "overlap.xyz", atoms)
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--system", "overlap.xyz", "--steps", "2", "--nproc", str(nproc), "--device", "cpu",
                 "--progress", "off"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert "atoms 3 and 7 overlap: 0 A apart" in err.strip().splitlines()[-1], err
