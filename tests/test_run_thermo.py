"""`mlipdd run`'s thermo log, CSV and summary as a LAMMPS user reads them (issue 24 item 6):
press (bar, metal units), vol, pe, ke, etotal, a ``--thermo`` column choice, optimiser
summaries, multi-frame structure files, and a distributed run's log equal to one process's."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys

import ase.io
import pytest
import torch
from ase import units
from ase.build import bulk
from mlipdd.cli import main
from mlipdd.dynamics import NVE
from mlipdd.dynamics.hooks import ThermoLogger
from mlipdd.lattices import fcc_argon
from mlipdd.models.lj import LennardJones
from mlipdd.testing.pytest_plugin import parse_world_sizes

QUIET = ["--progress", "off", "--device", "cpu"]


def pytest_generate_tests(metafunc):
    if "nproc" in metafunc.fixturenames:
        given = metafunc.config.getoption("mlipdd_world_sizes", None)
        metafunc.parametrize("nproc", parse_world_sizes(given) if given else (2, 3, 4))


def _lj():
    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.5)


def test_pressure_is_minus_de_dv_for_atoms_at_rest():
    """The virial part against a finite difference of the energy under isotropic scaling."""
    batch = fcc_argon(3, temperature=None)
    batch.positions = batch.positions * 0.97  # compressed: a clearly positive pressure
    batch.cell = batch.cell * 0.97
    batch.velocities = torch.zeros_like(batch.positions)
    logger = ThermoLogger(io.StringIO(), frequency=1)
    NVE(_lj(), 1.0, [logger]).run(batch, 0)
    pressure = logger.records[0]["pressure"]

    def energy(scale: float) -> float:
        scaled = fcc_argon(3, temperature=None)
        scaled.positions, scaled.cell = scaled.positions * 0.97 * scale, scaled.cell * 0.97 * scale
        return float(_lj()(scaled)["energy"].detach().sum())

    h = 1e-5
    volume = float(batch.cell[0].det().abs())
    de_dv = (energy(1 + h) - energy(1 - h)) / (2 * h) / (3 * volume)  # dV/ds = 3V at s = 1
    assert pressure > 1000.0
    assert pressure == pytest.approx(-de_dv / units.bar, rel=1e-7)


def test_the_kinetic_part_is_2ke_over_3v():
    batch = fcc_argon(3, temperature=300.0, seed=2)
    logger = ThermoLogger(io.StringIO(), frequency=1)
    NVE(_lj(), 1.0, [logger]).run(batch, 0)
    at_rest = fcc_argon(3, temperature=None)
    at_rest.velocities = torch.zeros_like(at_rest.positions)
    still = ThermoLogger(io.StringIO(), frequency=1)
    NVE(_lj(), 1.0, [still]).run(at_rest, 0)
    rec = logger.records[0]
    kinetic = 2 * rec["ekin"] / (3 * rec["volume"]) / units.bar
    assert rec["pressure"] - still.records[0]["pressure"] == pytest.approx(kinetic, rel=1e-9)


def _csv(path) -> list[dict[str, float]]:
    with open(path, newline="") as handle:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def test_default_log_has_press_and_the_csv_every_lammps_column(tmp_path, capsys):
    log, table = tmp_path / "thermo.log", tmp_path / "thermo.csv"
    assert main(["run", "--size", "2", "--steps", "10", "--log-every", "5", "--log-file", str(log),
                 "--thermo-csv", str(table), *QUIET]) == 0
    header = log.read_text().splitlines()[0].split()
    assert header == ["step", "time[ps]", "sys", "pe[eV]", "ke[eV]", "etotal[eV]", "econs[eV]",
                      "temp[K]", "press[bar]"]
    rows = _csv(table)
    assert list(rows[0])[:11] == ["step", "time_ps", "system", "pe", "ke", "etotal", "econs", "temp",
                                  "press", "vol", "fmax"]
    assert len(rows) == 3 and all(r["press"] == r["press"] for r in rows)  # not nan
    assert rows[0]["etotal"] == pytest.approx(rows[0]["pe"] + rows[0]["ke"])


def test_thermo_chooses_the_columns_and_refuses_unknown_ones(tmp_path, capsys):
    log = tmp_path / "thermo.log"
    assert main(["run", "--size", "2", "--steps", "4", "--log-every", "2", "--log-file", str(log),
                 "--thermo", "step,temp press_gpa vol", *QUIET]) == 0
    lines = log.read_text().splitlines()
    assert lines[0].split() == ["step", "temp[K]", "press[GPa]", "vol[A^3]"]
    assert len(lines) == 4 and all(len(line.split()) == 4 for line in lines[1:])
    capsys.readouterr()
    assert main(["run", "--size", "2", "--steps", "1", "--thermo", "step pressure", *QUIET]) == 2
    assert "thermo column(s) ['pressure'] unknown" in capsys.readouterr().err


def test_npt_logs_vol_and_rebuilds_rarely(tmp_path, capsys):
    log = tmp_path / "thermo.log"
    assert main(["run", "--size", "3", "--steps", "30", "--log-every", "10", "--log-file", str(log),
                 "--ensemble", "npt", "--pdamp", "200", "--json", *QUIET]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert log.read_text().splitlines()[0].split()[-2:] == ["press[bar]", "vol[A^3]"]
    assert summary["neighbor_list_builds"] <= 6  # was 31 in 30 steps


def test_fire_summary_reports_the_relaxation_not_md(tmp_path, capsys):
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True) * 2
    atoms.rattle(0.1, seed=3)
    path = tmp_path / "rattled.extxyz"
    ase.io.write(path, atoms)
    for ensemble in ("fire", "fire2"):
        assert main(["run", "--system", str(path), "--ensemble", ensemble, "--steps", "300",
                     "--fmax", "0.01", "--log-every", "0", *QUIET]) == 0
        text = capsys.readouterr().out
        assert f"{ensemble.upper()} lj on {path}: 32 atoms, converged to fmax 0.01 eV/A after" in text
        assert "max |F|" in text and "eV/atom" in text
        assert "ns/day" not in text and "drift" not in text and " fs " not in text


def test_a_multi_frame_file_runs_its_first_frame_and_says_so(tmp_path, capsys):
    frames = []
    for i in range(3):
        atoms = bulk("Ar", "fcc", a=5.26 + 0.05 * i, cubic=True) * 2
        frames.append(atoms)
    path = tmp_path / "frames.extxyz"
    ase.io.write(path, frames)
    volumes = {}
    for frame in (None, "2", "-1"):
        flags = [] if frame is None else ["--frame", frame]
        assert main(["run", "--system", str(path), "--steps", "0", "--log-every", "1", "--thermo",
                     "vol", *flags, *QUIET]) == 0
        out, err = capsys.readouterr()
        volumes[frame] = float(out.splitlines()[1])
        assert ("holds several frames: running the first" in err) == (frame is None)
    assert volumes[None] == pytest.approx(5.26**3 * 8, rel=1e-6)  # the log prints 3 decimals
    assert volumes["2"] == volumes["-1"] == pytest.approx(5.36**3 * 8, rel=1e-6)
    assert main(["run", "--system", str(path), "--frame", "7", *QUIET]) == 2
    assert "has no frame 7" in capsys.readouterr().err


def _run_csv(tmp_path, name, *flags):
    table = tmp_path / f"{name}.csv"
    result = subprocess.run(
        [sys.executable, "-m", "mlipdd", "run", "--ensemble", "nve", "--steps", "10", "--log-every", "5",
         "--thermo-csv", str(table), *QUIET, *flags],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    return _csv(table)


@pytest.fixture(scope="module")
def triclinic_one_process(tmp_path_factory):
    """A rattled triclinic argon file and its one-process log, once for every rank count."""
    folder = tmp_path_factory.mktemp("triclinic")
    atoms = bulk("Ar", "fcc", a=5.3) * (6, 6, 6)  # the primitive fcc cell: triclinic, 216 atoms
    atoms.rattle(0.05, seed=1)
    path = folder / "tri.extxyz"
    ase.io.write(path, atoms)
    return path, _run_csv(folder, "one", "--system", str(path))


def test_the_distributed_log_equals_one_process_in_a_triclinic_cell(tmp_path, nproc, triclinic_one_process):
    path, one = triclinic_one_process
    many = _run_csv(tmp_path, f"n{nproc}", "--system", str(path), "--nproc", str(nproc))
    assert len(one) == len(many) == 3
    for a, b in zip(one, many):
        for key in ("pe", "ke", "etotal", "temp", "press", "vol", "fmax"):
            assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-9), key
    assert torch.isfinite(torch.tensor([r["press"] for r in one])).all()
