"""Molecules, clusters and slabs without a cell (issue 24 item 4): a non-periodic box with
vacuum is given to them (`mlipdd.vacuum_box`, said in one line) so that `mlipdd run --nproc N`
runs them, equal to one process; the same box at every rank count."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import ase
import ase.io
import pytest
import torch
from ase.build import fcc111, molecule
from ase.cluster import Icosahedron
from mlipdd.data import Batch
from mlipdd.testing.pytest_plugin import parse_world_sizes
from mlipdd.vacuum_box import box_open_systems, needs_box

OPEN_SYSTEMS = ("cluster", "molecule", "slab")


def pytest_generate_tests(metafunc):
    """Each open system at one rank count, the counts taken in turn (cluster at 2, molecule at
    3, slab at 4), so that `mlipdd run --nproc` runs an open system at every count given: the
    box is made before the decomposition, the same at any count, and the conformance kit's
    vacuum cells check the decomposition itself at 2, 3 and 4 ranks."""
    if "nproc" in metafunc.fixturenames:
        given = metafunc.config.getoption("mlipdd_world_sizes", None)
        sizes = parse_world_sizes(given) if given else (2, 3, 4)
        cases = max(len(sizes), len(OPEN_SYSTEMS))
        metafunc.parametrize(("system", "nproc"),
                             [(OPEN_SYSTEMS[i % len(OPEN_SYSTEMS)], sizes[i % len(sizes)]) for i in range(cases)])


def test_the_box_holds_the_atoms_with_the_vacuum_and_shifts_them_only():
    atoms = molecule("CH3CH2OH")
    batch = Batch.from_ase(atoms)
    before = batch.positions.clone()
    (boxed,) = box_open_systems(batch, vacuum=7.0)
    extent = before.max(0).values - before.min(0).values
    torch.testing.assert_close(batch.cell[0], torch.diag(extent + 14.0))
    torch.testing.assert_close(batch.positions - before, boxed.shift.expand_as(before))
    assert float(batch.positions.min()) == pytest.approx(7.0)
    assert not bool(batch.pbc.any()) and not needs_box(batch, 0)


def test_periodic_and_already_boxed_systems_are_left_alone():
    bulk = Batch.from_ase(ase.Atoms("Ar2", positions=[[0, 0, 0], [2, 2, 2]], cell=[5, 5, 5], pbc=True))
    boxed = Batch.from_ase(ase.Atoms("Ar2", positions=[[4, 4, 4], [6, 6, 6]], cell=[10, 10, 10]))
    outside = Batch.from_ase(ase.Atoms("Ar2", positions=[[-1, 4, 4], [6, 6, 6]], cell=[10, 10, 10]))
    both = Batch.from_data_list([bulk, boxed, outside])
    cell = both.cell.clone()
    done = box_open_systems(both, vacuum=5.0)
    assert [b.system for b in done] == [2]  # an atom outside its non-periodic box: boxed
    torch.testing.assert_close(both.cell[:2], cell[:2])


def test_a_slab_and_a_wire_keep_their_periodic_vectors_and_gain_perpendicular_ones():
    slab = fcc111("Ar", size=(3, 3, 2), a=5.26)  # cell z = 0, pbc (T, T, F)
    wire = ase.Atoms("Ar3", positions=[[0, 0, 0], [1.2, 3.0, 0.5], [2.4, -1.0, 1.0]],
                     cell=[[3.6, 0, 0], [0, 0, 0], [0, 0, 0]], pbc=[True, False, False])
    for atoms in (slab, wire):
        batch = Batch.from_ase(atoms)
        periodic = batch.pbc[0].clone()
        kept = batch.cell[0][periodic].clone()
        (_boxed,) = box_open_systems(batch, vacuum=6.0)
        cell = batch.cell[0]
        torch.testing.assert_close(cell[periodic], kept)
        assert float(torch.linalg.det(cell)) > 0
        for axis in torch.nonzero(~periodic).flatten().tolist():
            for other in range(3):
                if other != axis:
                    assert abs(float(cell[axis] @ cell[other])) < 1e-9  # perpendicular
            along = batch.positions @ (cell[axis] / cell[axis].norm())
            assert float(along.min()) == pytest.approx(6.0) and float(cell[axis].norm() - along.max()) == pytest.approx(6.0)
        batch.validate()  # a periodic system with a full cell now, at one process too


def _run(tmp_path, name, *flags) -> tuple[dict, list[dict], str]:
    table = tmp_path / f"{name}.csv"
    result = subprocess.run(
        [sys.executable, "-m", "mlipdd", "run", "--ensemble", "nve", "--steps", "10", "--log-every", "5",
         "--thermo-csv", str(table), "--log-file", str(tmp_path / f"{name}.log"), "--progress", "off",
         "--device", "cpu", "--json", *flags],
        cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    with open(table, newline="") as handle:
        rows = [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(handle)]
    return json.loads(result.stdout), rows, result.stderr


def _open_system(system: str) -> tuple[ase.Atoms, list[str]]:
    if system == "cluster":
        return Icosahedron("Ar", 3), []  # 55 atoms
    if system == "molecule":  # ethanol with a soft LJ that keeps its atoms apart
        return molecule("CH3CH2OH"), ["--model-arg", "sigma=1.2", "--model-arg", "cutoff=4.0"]
    atoms = fcc111("Ar", size=(4, 4, 3), a=5.26)  # an fcc(111) slab without vacuum: no z vector
    atoms.rattle(0.02, seed=1)
    atoms.info.clear()  # ASE's adsorbate_info does not survive extxyz
    return atoms, []


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """The one-process run of a system (input file, flags, its thermo rows and stderr): once a
    system, shared by its cases (several when more rank counts than systems are given)."""
    done = {}

    def run(system: str):
        if system not in done:
            folder = tmp_path_factory.mktemp(f"one-{system}")
            atoms, flags = _open_system(system)
            ase.io.write(folder / "open.extxyz", atoms)
            _summary, rows, err = _run(folder, "one", "--system", "open.extxyz", *flags)
            done[system] = folder / "open.extxyz", flags, rows, err
        return done[system]

    return run


def test_a_cluster_and_a_molecule_without_a_cell_run_on_ranks_like_one_process(tmp_path, nproc, system,
                                                                               one_process_run):
    system_file, flags, one_rows, one_err = one_process_run(system)
    many, many_rows, many_err = _run(tmp_path, f"n{nproc}", "--system", str(system_file), "--nproc", str(nproc),
                                     *flags)
    for err in (one_err, many_err):
        assert err.count("no periodic box given: put in a non-periodic box with 10 A of vacuum") == 1
    assert many["ranks"] == nproc and many["atoms_conserved"]
    assert many["max_force_diff_eV_per_A"] < 1e-12
    assert len(one_rows) == len(many_rows) == 3
    for a, b in zip(one_rows, many_rows):
        for key in ("pe", "ke", "etotal", "temp", "fmax", "vol"):
            assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), key
