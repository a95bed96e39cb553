"""The README's "As a user" route from a fresh clone: `git clone`, `make dist`, then
`pip install --find-links dist 'mlipdd[mace,uma]'` into a fresh venv; MACE and UMA then run
under domain decomposition on 2 ranks.

`make dist` runs in a clone of the committed HEAD with a bare environment (no VIRTUAL_ENV,
no make variables from a calling `make test`): the clone's `make venv` makes a new .venv, as
on a user's machine. About 40 s on 2 cores, so it is in the default suite. The install test
is the `slow` tier's (mlipdd.testing.slow_tier; `make test-full` runs it): 1.5 min with pip's cache warm,
minutes more without (pip unpacks torch, fairchem and their dependencies into a new venv;
measured in the README), the largest single test of the suite, and no wheel built here can
stand in for that install. It is the only check that a user's install works: run `make
test-full` before a release and after a change to a pyproject, requirements/ or
tools/build_dist.py. Both need the package index (or a mirror) like `make install` does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "requirements" / "torch.txt"
EXTRAS = ("mace", "uma", "aimnet2", "ewald_pme", "all")


# What a user's shell has not: our venv, a checkout on the path, a calling make's variables
# (`make test` exports its own, and MAKEFLAGS would hand the inner make our jobserver).
NOT_A_USERS = ("PYTHONPATH", "VIRTUAL_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHON", "VENV",
               "DIST", "MLIPDD_SPAWN_PRELOAD")
WHEELS = ("mlipdd-", "mlipdd_mace-", "mlipdd_uma-", "mlipdd_aimnet2-", "mlipdd_ewald_pme-",
          "mace_torch-0.3.16+e3nn060-")


def _run(command: list[str], env: dict, timeout: float, cwd: Path | None = None) -> str:
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False,
                         timeout=timeout, cwd=cwd)
    assert out.returncode == 0, f"{' '.join(command)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _users_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in NOT_A_USERS}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def fresh_clone_dist():
    """`git clone` of the committed HEAD, then its `make dist`: (dist folder, seconds taken)."""
    tmp = Path(tempfile.mkdtemp(prefix="mlipdd-dist-test-"))
    try:
        clone, env = tmp / "clone", _users_env()
        _run(["git", "clone", "--quiet", str(ROOT), str(clone)], env, 300)
        start = time.monotonic()
        _run(["make", "dist"], env, 900, cwd=clone)
        yield clone / "dist", time.monotonic() - start
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_make_dist_builds_every_wheel_on_a_fresh_clone(fresh_clone_dist):
    dist, seconds = fresh_clone_dist
    wheels = sorted(p.name for p in dist.glob("*.whl"))
    print(f"make dist on a fresh clone: {seconds:.0f} s")
    for name in WHEELS:
        assert sum(w.startswith(name) for w in wheels) == 1, (name, wheels)
    assert len(wheels) == len(WHEELS), wheels


@pytest.mark.slow
def test_wheels_install_into_a_fresh_venv_and_run_mace_and_uma_distributed(fresh_clone_dist):
    # the checkout must not leak in: only what pip installed may be imported
    env = _users_env()
    dist = fresh_clone_dist[0]
    tmp = Path(tempfile.mkdtemp(prefix="mlipdd-install-test-"))
    try:
        venv = tmp / "venv"
        _run([sys.executable, "-m", "venv", str(venv)], env, 300)
        # --no-compile: pip would byte-compile every file of torch, scipy, sympy ... (~10k, tens
        # of seconds) and ignores a file that fails to compile; the imports below compile what
        # they import, and fail on a file that does not
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        install = [*pip, "install", "--no-compile"]
        start = time.monotonic()
        # the README's command, verbatim apart from the paths (and --no-compile)
        _run([*install, "--find-links", str(dist), "-c", str(CONSTRAINTS), "mlipdd[mace,uma]"], env, 1500)
        print(f"pip install 'mlipdd[mace,uma]' into a fresh venv: {time.monotonic() - start:.0f} s")
        listed = _run([*pip, "list", "--format=freeze"], env, 120).lower()
        for pin in ("torch==2.13.0", "e3nn==0.6.0", "mace-torch==0.3.16+e3nn060",
                    "fairchem-core==2.24.0", "mlipdd-mace==0.1.0", "mlipdd-uma==0.1.0"):
            assert pin in listed, pin
        # no `torchsim` extra here: importing the adapter says which extra to install, in one line
        assert "torch-sim-atomistic" not in listed
        out = subprocess.run([str(venv / "bin" / "python"), "-c", "import mlipdd.torchsim"], env=env,
                             capture_output=True, text=True, check=False, timeout=300)
        assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
            "ImportError: mlipdd.torchsim needs torch-sim (torch-sim-atomistic): "
            "pip install 'mlipdd[torchsim]'"), out.stderr

        plugins = _run([str(venv / "bin" / "mlipdd"), "plugins", "--strict"], env, 300)
        assert "mace" in plugins and "uma" in plugins
        script = ROOT / "tests" / "packaging" / "installed_models_under_dd.py"
        # the ranks' forkserver imports mace and fairchem once, not each rank (seconds a rank)
        preload = dict(env, MLIPDD_SPAWN_PRELOAD="mace.modules,fairchem.core.models.uma.escn_md")
        ran = _run([str(venv / "bin" / "python"), str(script), "mace", "uma"], preload, 900)
        assert "mace 2 ranks" in ran and "uma 2 ranks" in ran, ran

        # [all] on top, then every extra resolves against what is installed, offline: one
        # resolver pass over all of them (what is installed satisfies each extra's
        # requirements exactly when it satisfies their union)
        _run([*install, "--find-links", str(dist), "-c", str(CONSTRAINTS), "mlipdd[all]"], env, 900)
        report = _run([*pip, "install", "--dry-run", "--no-index", "--find-links", str(dist),
                       "-c", str(CONSTRAINTS), f"mlipdd[{','.join(EXTRAS)}]"], env, 300)
        assert "Would install" not in report, report
        listed = _run([*pip, "list", "--format=freeze"], env, 120).lower()
        assert "mlipdd-aimnet2==0.1.0" in listed and "mlipdd-ewald-pme==0.1.0" in listed, listed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
