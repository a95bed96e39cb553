"""``mlipdd run`` and `run_simulation`: flags, config files, summary, trajectory."""

from __future__ import annotations

import json

import pytest
from mlipdd.cli import main
from mlipdd.data import InputError

TINY = ["--size", "2", "--steps", "6", "--log-every", "0", "--progress", "off", "--device", "cpu"]


def run_json(capsys, *flags) -> dict:
    assert main(["run", *TINY, *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_run_with_tiny_flags_prints_a_summary(capsys):
    assert main(["run", *TINY]) == 0
    out = capsys.readouterr().out
    assert "NVT lj on fcc_argon: 32 atoms, 6 steps" in out
    assert "atom-steps/s" in out and "drift" in out and "temperature" in out


def test_summary_fields(capsys):
    s = run_json(capsys, "--ensemble", "nve", "--dt", "2", "--temperature", "40")
    assert (s["n_atoms"], s["steps"], s["ensemble"], s["dt_fs"]) == (32, 6, "nve", 2.0)
    assert s["steps_per_s"] > 0 and s["atom_steps_per_s"] == pytest.approx(32 * s["steps_per_s"])
    assert abs(s["energy_drift_meV_per_atom"]) < 1e-2
    assert 0 < s["temperature_mean_K"] < 100


def test_config_file_and_flags_override(capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("ensemble: nve\nsteps: 50\nmodel_args:\n  cutoff: 6.0\nseed: 3\n")
    s = run_json(capsys, "--config", str(config), "--steps", "4")
    assert s["steps"] == 4 and s["ensemble"] == "nve"  # the flag wins, the file fills in
    as_json = tmp_path / "run.json"
    as_json.write_text(json.dumps({"ensemble": "nve", "log-every": 0}))
    assert run_json(capsys, "--config", str(as_json))["ensemble"] == "nve"


def test_model_args_reach_the_model():
    from mlipdd.app.simulation import RunConfig, build_model
    from mlipdd.cli.run_cmd import parse_model_args

    args = parse_model_args(["cutoff=6.5", "shift=false", "mixing=geometric"])
    assert args == {"cutoff": 6.5, "shift": False, "mixing": "geometric"}
    model = build_model(RunConfig(model_args=args, device="cpu"))
    assert model.cutoff == 6.5 and model.shift is False
    with pytest.raises(InputError, match="KEY=VALUE"):
        parse_model_args(["cutoff"])


def test_trajectory_from_the_command_line(capsys, tmp_path):
    import ase.io

    path = tmp_path / "md.extxyz"
    run_json(capsys, "--trajectory", str(path), "--trajectory-every", "2")
    assert len(ase.io.read(path, ":")) == 4  # steps 0, 2, 4, 6


def test_structure_file_as_system(capsys, tmp_path):
    import ase.io
    from ase.build import bulk

    path = tmp_path / "ar.xyz"
    ase.io.write(path, bulk("Ar", "fcc", a=5.26, cubic=True), format="extxyz")
    s = run_json(capsys, "--system", str(path))
    assert s["n_atoms"] == 32  # 4 atoms, repeated 2x2x2 by --size


def test_bad_settings_name_the_fix(tmp_path):
    from mlipdd.app.simulation import RunConfig, run_simulation

    with pytest.raises(InputError, match="known settings"):
        RunConfig.from_mapping({"stepz": 3})
    with pytest.raises(InputError, match="neither a built-in"):
        run_simulation({"system": str(tmp_path / "missing.xyz"), "steps": 1})
    with pytest.raises(InputError, match="ensemble"):
        RunConfig.from_mapping({"ensemble": "npx"})
