"""``mlipdd run --compile`` / ``--cuda-graph`` at one process: flags, the run equal to the
eager one, the summary naming the force call, refusals as one-line errors. The CUDA
graph's capture is swapped for eager replays on CPU (`mlipdd.testing.graph_replay`)."""

from __future__ import annotations

import json

import pytest
from mlipdd.app.simulation import (
    RunConfig,
    _run_one_rank,
    build_model,
    format_summary,
    prepare_system,
    run_simulation,
)
from mlipdd.cli import build_parser, main
from mlipdd.cli.run_cmd import config_from_args
from mlipdd.testing.graph_replay import with_eager_replay

MD = ["--ensemble", "nve", "--steps", "25", "--system", "lj_liquid", "--device", "cpu"]
QUIET = ["--log-every", "0", "--progress", "off"]


def run_json(capsys, *args: str) -> dict:
    assert main(["run", *QUIET, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _config(*flags: str) -> RunConfig:
    return config_from_args(build_parser().parse_args(["run", *flags]))


def test_force_call_flags_parse():
    assert _config().compile is None and _config().cuda_graph is False
    assert _config("--compile").compile == "inductor"
    assert _config("--compile", "aot_eager").compile == "aot_eager"
    assert _config("--cuda-graph").cuda_graph is True


def test_compiled_run_equals_the_eager_run(capsys):
    eager = run_json(capsys, *MD)
    compiled = run_json(capsys, *MD, "--compile", "aot_eager")
    assert "force_call" not in eager  # the plain one-process integrator
    assert compiled["force_call"] == "compiled (aot_eager)", compiled
    stats = compiled["compile"]
    assert 1 <= stats["compiles"] <= 2 and stats["checks"] >= 1, stats  # one graph per stress flag at most
    for key in ("conserved_energy_start_eV", "temperature_final_K", "energy_drift_meV_per_atom"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-9, abs=1e-12), key
    assert compiled["neighbor_list_builds"] >= 1
    # the text summary (what `mlipdd run` prints without --json) names the force call
    text = format_summary(compiled)
    assert "force call   compiled (aot_eager): " in text and "after the first" in text, text


def test_cuda_graph_run_replayed_eagerly_equals_the_eager_run(capsys):
    """Everything `--cuda-graph` does at one process but the capture (CPU)."""
    settings = {"ensemble": "nve", "steps": 25, "system": "lj_liquid", "device": "cpu", "log_every": 0,
                "progress": "off"}
    eager = run_simulation(settings)
    cfg, batch, _ = prepare_system(RunConfig.from_mapping({**settings, "cuda_graph": True}))
    graphed = _run_one_rank(cfg, build_model(cfg), batch, None, adjust=with_eager_replay)
    assert graphed["force_call"] == "cuda graph" and graphed["cuda_graph_captures"] >= 1, graphed
    for key in ("conserved_energy_start_eV", "temperature_final_K", "energy_drift_meV_per_atom"):
        assert graphed[key] == pytest.approx(eager[key], rel=1e-9, abs=1e-12), key


def test_force_call_refusals_are_one_line_errors(capsys):
    """In this process (`mlipdd.cli.main`, what `python -m mlipdd` runs); a fresh process's
    one-line errors are checked in tests/test_run_app.py and tests/faults."""
    cases = [
        (("--cuda-graph", "--device", "cpu"), "CUDA device"),
        (("--compile", "--cuda-graph"), "choose one"),
        (("--cuda-graph", "--nproc", "2"), "one rank"),
    ]
    for flags, words in cases:
        try:
            code = main(["run", "--size", "2", "--steps", "1", "--progress", "off", *flags])
        except SystemExit as done:  # an argparse-level refusal exits as it does in a fresh process
            code = done.code
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, (flags, err)
        assert words in err, (flags, err)


def test_compiled_run_on_two_ranks_equals_the_eager_run(capfd):
    """LJ is an energy model: compiled on each rank's plain rows under halo storage."""
    eager = run_json(capfd, *MD, "--nproc", "2")
    compiled = run_json(capfd, *MD, "--nproc", "2", "--compile", "aot_eager")
    assert eager["force_call"] == "eager" and compiled["force_call"] == "compiled (aot_eager)", compiled
    assert compiled["ranks"] == 2 and compiled["strategy"] == "halo"
    for key in ("conserved_energy_start_eV", "temperature_final_K", "energy_drift_meV_per_atom"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-9, abs=1e-12), key
