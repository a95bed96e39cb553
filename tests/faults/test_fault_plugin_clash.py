"""Two installed plugins registering the same model name (catalogue P1; issue 25 item
14: every command failed, ``mlipdd run --model lj`` too).

The rivals are real distributions (tests/fixtures/plugins/rival_a, rival_b) pip-installed
into a private directory on ``sys.path`` / ``PYTHONPATH``, so discovery goes through
their entry points and dist metadata, as it does for a user's two packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fault_helpers import mlipdd_command
from mlipdd import plugins
from mlipdd.cli import main

FIXTURES = Path(__file__).parents[1] / "fixtures" / "plugins"
RIVALS = ("mlipdd_fixture_rival_a", "mlipdd_fixture_rival_b")
CLASH = "model 'fixture_twin' is registered by both plugin 'fixture_rival_a' and plugin 'fixture_rival_b'"
QUICK = ["--size", "2", "--steps", "2", "--log-every", "0", "--progress", "off", "--device", "cpu"]


@pytest.fixture(scope="module")
def rival_site(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("rivals")
    for name in ("rival_a", "rival_b"):
        shutil.copytree(FIXTURES / name, work / name)  # build from a copy: no build/ in tests/
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(work / "site"), str(work / "rival_a"), str(work / "rival_b")],
        check=True,
    )  # fmt: skip
    return work / "site"


@pytest.fixture
def rivals_installed(rival_site, monkeypatch):
    monkeypatch.delenv(plugins.AUTOLOAD_ENV_VAR, raising=False)
    sys.path.insert(0, str(rival_site))
    plugins.reset_registry()
    yield rival_site
    sys.path.remove(str(rival_site))
    for module in [m for m in sys.modules if m.split(".")[0] in RIVALS]:
        del sys.modules[module]
    plugins.reset_registry()


def _registry():
    with pytest.warns(RuntimeWarning, match="fixture_twin"):
        return plugins.registry()


def test_a_clash_disables_both_rivals_and_names_them(rivals_installed):
    reg = _registry()
    failed = {f.name: f.error for f in reg.failed}
    assert set(failed) >= {"fixture_rival_a", "fixture_rival_b"}
    for error in (failed["fixture_rival_a"], failed["fixture_rival_b"]):
        assert CLASH in error and "both are disabled" in error
    # disabled whole: neither the twin nor the rivals' own models; everything else is there
    assert not {"fixture_twin", "fixture_rival_a_own", "fixture_rival_b_own"} & set(reg.models)
    assert "lj" in reg.models and "halo" in reg.strategies
    assert not {"fixture_rival_a", "fixture_rival_b"} & {p.name for p in reg.plugins}


def test_the_rest_works_and_the_twin_is_refused_naming_the_clash(rivals_installed, capsys):
    _registry()
    assert main(["run", "--model", "lj", *QUICK]) == 0
    capsys.readouterr()
    assert main(["run", "--model", "fixture_twin", *QUICK]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'fixture_twin'" in err and CLASH in err


def test_plugins_lists_the_clash_and_strict_exits_1(rivals_installed, capsys):
    _registry()
    assert main(["plugins", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert {f["name"] for f in listing["failed"]} >= {"fixture_rival_a", "fixture_rival_b"}
    assert main(["plugins", "--strict"]) == 1
    assert CLASH in capsys.readouterr().out


def test_the_installed_command_still_runs_lj(rivals_installed):
    """The user's view: a fresh process that discovers both rivals through PYTHONPATH."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(rivals_installed), os.environ.get("PYTHONPATH", "")]))
    env.pop(plugins.AUTOLOAD_ENV_VAR, None)
    for nproc in ("1", "2"):
        result = subprocess.run(mlipdd_command("run", "--model", "lj", *QUICK, "--nproc", nproc), env=env,
                                capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stderr
        assert "NVT lj" in result.stdout  # warned, not fatal: one line per rival, once, not per rank
        warned = [line for line in result.stderr.splitlines() if CLASH in line]
        assert len(warned) == 2 and all(line.startswith("mlipdd: warning: ") for line in warned), result.stderr
        assert "RuntimeWarning" not in result.stderr
    strict = subprocess.run(mlipdd_command("plugins", "--strict"), env=env, capture_output=True,
                            text=True, timeout=120, check=False)
    assert strict.returncode == 1 and CLASH in strict.stdout
