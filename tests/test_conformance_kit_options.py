"""The conformance kit's pytest option: ``--mlipdd-world-sizes`` sets the rank counts of
every `conformance_suite`; without it each suite keeps its own. Collection only: no
ranks are spawned here (the suites themselves run in the plugins' tests)."""

import subprocess
import sys

SUITE = '''
from mlipdd.testing import conformance_suite
from mlipdd.testing.toy_models import ToyMPNN

test_toy = conformance_suite(ToyMPNN, world_sizes=(2,), cells=("cubic",))
'''


def _collect(tmp_path, *options) -> subprocess.CompletedProcess:
    (tmp_path / "test_suite_demo.py").write_text(SUITE)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *options,
         str(tmp_path / "test_suite_demo.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )


def _ids(result) -> list[str]:
    return sorted(line.split("::", 1)[1] for line in result.stdout.splitlines() if "::" in line)


def test_each_suite_keeps_its_own_world_sizes(tmp_path):
    result = _collect(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _ids(result) == ["test_toy[2-cubic]"]


def test_command_line_world_sizes_override_the_suite(tmp_path):
    result = _collect(tmp_path, "--mlipdd-world-sizes=3,4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert _ids(result) == ["test_toy[3-cubic]", "test_toy[4-cubic]"]


def test_a_bad_value_names_the_fix(tmp_path):
    result = _collect(tmp_path, "--mlipdd-world-sizes=two")
    assert result.returncode != 0
    assert "write e.g. --mlipdd-world-sizes=2,3,4" in result.stdout + result.stderr
