"""`mlipdd run` as a user meets it: every ensemble, restart, strategies, defaults that suit
the system, one-line errors (1 and 2 ranks), plain --help, CSV thermo and `mlipdd plot`."""

from __future__ import annotations

import json
import subprocess
import sys

import ase.io
import numpy as np
import pytest
from mlipdd.app.ensembles import ENSEMBLES
from mlipdd.cli import main

SMALL = ["--size", "2", "--log-every", "0", "--progress", "off", "--json"]


def mlipdd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m mlipdd ARGS`` in a fresh process (exit code and stderr as a user sees them)."""
    return subprocess.run([sys.executable, "-m", "mlipdd", *args], capture_output=True, text=True,
                          check=False, timeout=timeout)


def run_json(capsys, *args: str) -> dict:
    assert main(["run", *SMALL, *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("ensemble", sorted(ENSEMBLES))
def test_every_ensemble_runs(capsys, ensemble):
    s = run_json(capsys, "--ensemble", ensemble, "--steps", "6", "--system", "lj_liquid")
    assert s["ensemble"] == ensemble and s["n_atoms"] > 0
    if ensemble in ("fire", "fire2"):
        assert "converged" in s and s["temperature_final_K"] < 1.0  # relaxations start at rest
    else:
        assert s["steps"] == 6 and s["temperature_final_K"] > 10.0


def test_defaults_follow_the_system_and_long_steps_with_hydrogen_warn(capsys, tmp_path):
    from ase.build import molecule

    water = molecule("H2O")
    water.cell, water.pbc = [6.0, 6.0, 6.0], True
    path = tmp_path / "water.xyz"
    ase.io.write(path, water.repeat(2))
    argon = run_json(capsys, "--steps", "1")
    assert (argon["dt_fs"], argon["temperature_K"]) == (5.0, 94.0)
    # a soft LJ that leaves the molecules' bonds alone (argon's sigma would blow them apart)
    soft = ["--model-arg", "sigma=0.5", "--model-arg", "epsilon=0.001", "--model-arg", "cutoff=2.0"]
    s = run_json(capsys, "--steps", "1", "--system", str(path), *soft)
    assert (s["dt_fs"], s["temperature_K"]) == (0.5, 300.0)
    assert "warning" not in capsys.readouterr().err
    assert main(["run", *SMALL, "--steps", "1", "--system", str(path), "--dt", "5", *soft]) == 0
    err = capsys.readouterr().err
    assert "warning: a 5 fs time step is long" in err and "--dt 0.5" in err


def _checkpoint_after(steps: int, path) -> None:
    from mlipdd.app.ensembles import build_dynamics
    from mlipdd.app.simulation import RunConfig, build_model, prepare_system
    from mlipdd.distributed.checkpoint import save_checkpoint

    cfg = RunConfig.from_mapping({"size": 2, "seed": 3, "system": "lj_liquid"})
    model = build_model(cfg)
    cfg, batch, _ = prepare_system(cfg)
    dyn = build_dynamics(cfg, model)
    dyn.run(batch, steps)
    save_checkpoint(path, batch, dyn)


def _last_frame_minimum_image(a, b) -> float:
    d = np.linalg.solve(b.cell.T, (a.positions - b.positions).T).T
    return float(np.abs((d - np.round(d)) @ b.cell).max())


def test_restart_continues_the_run_on_one_and_two_ranks(capsys, tmp_path):
    """A checkpoint at step 10 + 10 more steps == 20 steps straight (Langevin noise is keyed
    by step and atom id), on one rank exactly and on two ranks (sharded) to the file's
    precision."""
    _checkpoint_after(10, tmp_path / "state.pt")
    common = ["--system", "lj_liquid", "--seed", "3", "--trajectory-every", "10"]
    straight = run_json(capsys, *common, "--steps", "20", "--trajectory", str(tmp_path / "a.extxyz"))
    one = run_json(capsys, *common, "--steps", "10", "--restart", str(tmp_path / "state.pt"),
                   "--trajectory", str(tmp_path / "b.extxyz"))
    two = mlipdd("run", *SMALL, *common, "--steps", "10", "--restart", str(tmp_path / "state.pt"),
                 "--trajectory", str(tmp_path / "c.extxyz"), "--nproc", "2", "--strategy", "sharded")
    assert two.returncode == 0, two.stderr
    two_summary = json.loads(two.stdout)
    assert straight["final_step"] == one["final_step"] == two_summary["final_step"] == 20
    assert two_summary["strategy"] == "sharded" and two_summary["atoms_conserved"]
    a, b, c = (ase.io.read(tmp_path / f"{n}.extxyz", -1) for n in "abc")
    assert np.abs(b.positions - a.positions).max() == 0.0
    assert _last_frame_minimum_image(c, a) < 1e-7  # extxyz keeps 8 decimals


def test_errors_are_one_line_with_exit_code_2_on_one_rank_and_on_two(tmp_path, capsys):
    in_process = [
        ("run", "--ensemble", "npx"),  # argparse
        ("run", "--steps", "1", "--model-arg", "cutoff=-1"),  # model settings
        ("plot", str(tmp_path / "missing.csv")),
    ]
    for args in in_process:  # `mlipdd.cli.main`, what `python -m mlipdd` runs
        try:
            code = main(list(args))
        except SystemExit as done:  # argparse exits as it does in a fresh process
            code = done.code
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1 and "error:" in err, (args, err)
    # a fresh process as a user meets it (nothing but the line on stderr), on one rank ...
    out = mlipdd("run", "--system", str(tmp_path / "missing.xyz"))
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "error:" in out.stderr, out.stderr
    # ... and on two: bad input detected inside the run says it once too
    out = mlipdd("run", "--size", "2", "--steps", "2", "--nproc", "2", "--model-arg", "cutoff=-1")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def _help(capsys, command: str) -> str:
    """``mlipdd COMMAND --help``'s text (in this process: argparse prints the same text and
    exits 0 as in a fresh one, where it would cost an interpreter start a command)."""
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_is_plain_and_lists_the_systems(capsys):
    from mlipdd.lattices import SYSTEMS

    for command in ("run", "plot", "plugins", "validate"):
        text = _help(capsys, command)
        assert "``" not in text and "`" not in text, command
    text = _help(capsys, "run")
    for internal in ("RunConfig", "DomainParallel", "StrategyKind"):
        assert internal not in text
    assert all(name in text for name in SYSTEMS)
    assert all(name in text for name in ENSEMBLES) and "graph_partition" in text


def test_thermo_csv_and_plot(capsys, tmp_path):
    import matplotlib.image

    csv_npt, csv_nvt = tmp_path / "npt.csv", tmp_path / "nvt.csv"
    text = ["--log-every", "5", "--log-file", str(tmp_path / "thermo.log")]  # stdout stays JSON
    run_json(capsys, "--ensemble", "npt", "--steps", "20", *text, "--thermo-csv", str(csv_npt),
             "--pdamp", "200")
    run_json(capsys, "--steps", "20", *text, "--thermo-csv", str(csv_nvt))
    rows = csv_npt.read_text().splitlines()
    assert rows[0].split(",")[:3] == ["step", "time_ps", "system"] and len(rows) == 1 + 5
    assert main(["plot", str(csv_npt)]) == 0 and main(["plot", str(csv_nvt), "-o", str(tmp_path / "v.png")]) == 0
    npt = matplotlib.image.imread(tmp_path / "npt.png")
    nvt = matplotlib.image.imread(tmp_path / "v.png")
    assert npt.shape[0] > 1.3 * nvt.shape[0]  # the NPT plot has its volume panel
    assert npt.std() > 0.05  # curves and labels, not a blank canvas


def test_progress_lines_in_a_log_never_carry_carriage_returns():
    out = mlipdd("run", "--size", "2", "--steps", "30", "--progress", "on", "--log-every", "10")
    assert out.returncode == 0 and "\r" not in out.stderr and "\r" not in out.stdout
