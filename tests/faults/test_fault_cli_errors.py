"""Plain input errors of ``mlipdd run`` are one line on stderr and exit code 2 (catalogue
E1-E6; issue 25 item 13: each was a raw traceback).

In-process cases call ``mlipdd.cli.main``; the output cases start the real command (one
process and two ranks) because the failing writer runs inside a rank. A read-only
directory needs a user the kernel refuses: as root, the run drops its capabilities
(``setpriv``), so the refusal is the kernel's, not a simulation of it. A full disk is the
kernel's EFBIG under ``RLIMIT_FSIZE`` (the same OSError path as ENOSPC).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess

import ase
import ase.io
import pytest
import torch
from fault_helpers import mlipdd_command
from mlipdd.cli import main

QUICK = ["--size", "2", "--steps", "2", "--log-every", "0", "--progress", "off", "--device", "cpu"]
RUN_IN_SUBPROCESS = ["--size", "3", "--log-every", "0", "--progress", "off", "--device", "cpu"]


def one_error_line(capsys_or_text) -> str:
    text = capsys_or_text if isinstance(capsys_or_text, str) else capsys_or_text.readouterr().err
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    assert lines[0].startswith("mlipdd run: error: "), text
    return lines[0]


@pytest.mark.parametrize(
    "content, named",
    [
        ("steps: abc\n", "setting steps: 'abc' is not an integer"),
        ("dt: [1]\n", "setting dt: [1] is not a number"),
        ("size: 2.5\n", "setting size: 2.5 is not an integer"),
        ("steps: true\n", "setting steps: True is not an integer"),
        ("grid: [2, x, 1]\n", "setting grid: [2, 'x', 1] is not a list of integers"),
        ("model_args: 3\n", "setting model_args: 3 is not a mapping"),
        ("steps: [\n", "is not valid YAML at line 2"),
    ],
)
def test_a_config_value_of_the_wrong_type_is_one_line(tmp_path, capsys, content, named):
    config = tmp_path / "run.yaml"
    config.write_text(content)
    assert main(["run", "--config", str(config), "--progress", "off", "--device", "cpu"]) == 2
    assert named in one_error_line(capsys)


def test_bad_json_config_is_one_line(tmp_path, capsys):
    config = tmp_path / "run.json"
    config.write_text("{steps: 3}")
    assert main(["run", "--config", str(config)]) == 2
    assert "is not valid JSON" in one_error_line(capsys)


@pytest.mark.parametrize(
    "arg, named",
    [
        ("foo=1", "model 'lj' takes no argument 'foo'; its arguments are epsilon, sigma, cutoff"),
        ("epsilon=abc", "model 'lj' could not be built from epsilon='abc'"),
        ("mixing=[1]", "unknown mixing rule [1]"),
    ],
)
def test_a_bad_model_argument_is_one_line(capsys, arg, named):
    assert main(["run", "--model-arg", arg, *QUICK]) == 2
    assert named in one_error_line(capsys)


def test_model_args_in_the_config_and_as_flags_merge(tmp_path):
    """One documented name (config ``model_args``, flag ``--model-arg``); the other
    spellings (config ``model_arg``, flag ``--model-args``) are accepted, not refused."""
    from mlipdd.cli import build_parser
    from mlipdd.cli.run_cmd import config_from_args

    config = tmp_path / "run.yaml"
    config.write_text("model_arg: [sigma=3.3]\nmodel_args: {epsilon: 0.0101}\n")
    args = build_parser().parse_args(
        ["run", "--config", str(config), "--model-args", "cutoff=7.0", "--model-arg", "shift=false"]
    )
    assert config_from_args(args).model_args == {"sigma": 3.3, "epsilon": 0.0101, "cutoff": 7.0,
                                                 "shift": False}


@pytest.fixture
def mace_registered():
    from mlipdd.plugins import registry

    if "mace" not in registry().models:
        pytest.skip("the mace plugin (mlipdd-mace) is not installed")


@pytest.mark.parametrize("content", [None, b"garbage\n", b"PK\x03\x04" + b"\x00" * 64])
def test_a_missing_or_corrupt_model_file_is_one_line(tmp_path, capsys, mace_registered, content):
    path = tmp_path / "my.model"
    if content is not None:
        path.write_bytes(content)
    assert main(["run", "--model", "mace", "--model-arg", f"path={path}", *QUICK]) == 2
    line = one_error_line(capsys)
    assert "model 'mace' could not be built from path=" in line and str(path) in line
    if content is not None:
        assert "a model file that 'mace' reads" in line


@pytest.mark.parametrize(
    "name, content",
    [("bad.xyz", "not an xyz\n1 2 3\n"), ("cut.extxyz", None), ("empty.cif", "")],
)
def test_a_corrupt_structure_file_is_one_line(tmp_path, capsys, name, content):
    path = tmp_path / name
    if content is None:  # a frame cut short, as by a full disk
        ase.io.write(path, ase.Atoms("Ar4", positions=[[0, 0, i] for i in range(4)], cell=[9, 9, 9],
                                     pbc=True))
        path.write_text(path.read_text()[:-40])
    else:
        path.write_text(content)
    assert main(["run", "--system", str(path), *QUICK]) == 2
    assert str(path) in one_error_line(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", "gpu"])
def test_a_device_this_machine_lacks_is_one_line(capsys, device):
    assert main(["run", *QUICK[:-2], "--device", device]) == 2
    assert f"device {device!r}" in one_error_line(capsys)


# ---- outputs, written inside the ranks --------------------------------------------------
def _run(tmp_path, *args, fsize_limit=None, drop_root=False, command=None):
    """``mlipdd run RUN_IN_SUBPROCESS ARGS`` in a subprocess (or ``command``, as given)."""
    prefix = []
    if drop_root and os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root, a read-only directory needs setpriv to drop CAP_DAC_OVERRIDE")
        caps = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]

    def limit():
        if fsize_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))

    return subprocess.run(
        [*prefix, *(command or mlipdd_command("run", *RUN_IN_SUBPROCESS, *args))], cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=180,
        preexec_fn=limit, check=False)


OUTPUT_FLAGS = ("--trajectory", "--checkpoint", "--thermo-csv", "--log-file")
# `mlipdd run` refuses an unwritable output in its own process, before any rank starts, so
# one unprivileged process runs every (flag, nproc) case through the command's entry point
# `main`: one interpreter and torch import instead of eight. Were the check left to the
# ranks, the --nproc 2 cases would start them and their error would not be the one line.
_EVERY_READ_ONLY_CASE = """
import contextlib, io, json, sys
from mlipdd.cli import main
results = {}
for flag, nproc in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["run", *json.loads(sys.argv[2]), flag, "ro/out.file", "--steps", "2",
                         "--nproc", str(nproc)])
        except SystemExit as exc:
            code = exc.code
    results[f"{flag} {nproc}"] = {"code": code, "stderr": err.getvalue()}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def read_only_refusals(tmp_path_factory) -> dict:
    import json
    import sys

    work = tmp_path_factory.mktemp("read_only")
    (work / "ro").mkdir()
    (work / "ro").chmod(0o555)
    cases = [[flag, nproc] for flag in OUTPUT_FLAGS for nproc in (1, 2)]
    out = _run(work, drop_root=True, command=[sys.executable, "-c", _EVERY_READ_ONLY_CASE,
                                              json.dumps(cases), json.dumps(RUN_IN_SUBPROCESS)])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("flag", OUTPUT_FLAGS)
def test_a_read_only_output_directory_is_one_line_before_the_run(read_only_refusals, nproc, flag):
    result = read_only_refusals[f"{flag} {nproc}"]
    assert result["code"] == 2, result["stderr"]
    line = one_error_line(result["stderr"])
    assert "ro/out.file" in line and "Permission denied" in line and flag in line


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_full_disk_while_writing_a_checkpoint_is_one_line(tmp_path, nproc):
    # 8 kB: the run's other files fit, a 108-atom checkpoint does not
    result = _run(tmp_path, "--steps", "4", "--checkpoint", "out/state.pt", "--checkpoint-every", "2",
                  "--nproc", str(nproc), fsize_limit=8192)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert "cannot write the checkpoint 'out/state.pt'" in line and "EFBIG" in line
