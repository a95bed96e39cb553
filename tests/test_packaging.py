"""`make dist`, then `pip install --find-links dist 'mlipdd[mace,uma]'` into a fresh venv,
exactly as the README says; MACE and UMA then run under domain decomposition on 2 ranks.

Slow (minutes: pip unpacks torch, fairchem and their dependencies into a new venv;
measured in the README), but it is the only check that a user's install works, so `make
test` runs it; deselect locally with ``-m "not slow"``. Needs the package index (or a
mirror) like `make install` does.
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


def _run(command: list[str], env: dict, timeout: float) -> str:
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(command)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.slow
def test_wheels_install_into_a_fresh_venv_and_run_mace_and_uma_distributed():
    # the checkout must not leak in: only what pip installed may be imported
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="mlipdd-dist-test-"))
    try:
        dist, venv = tmp / "dist", tmp / "venv"
        _run([sys.executable, str(ROOT / "tools" / "build_dist.py"), str(dist)], env, 600)
        wheels = sorted(p.name for p in dist.glob("*.whl"))
        for name in ("mlipdd-", "mlipdd_mace-", "mlipdd_uma-", "mlipdd_aimnet2-",
                     "mlipdd_ewald_pme-", "mace_torch-0.3.16+e3nn060-"):
            assert any(w.startswith(name) for w in wheels), (name, wheels)

        _run([sys.executable, "-m", "venv", str(venv)], env, 300)
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        start = time.monotonic()
        # the README's command, verbatim apart from the paths
        _run([*pip, "install", "--find-links", str(dist), "-c", str(CONSTRAINTS), "mlipdd[mace,uma]"],
             env, 1500)
        print(f"pip install 'mlipdd[mace,uma]' into a fresh venv: {time.monotonic() - start:.0f} s")
        listed = _run([*pip, "list", "--format=freeze"], env, 120).lower()
        for pin in ("torch==2.13.0", "e3nn==0.6.0", "mace-torch==0.3.16+e3nn060",
                    "fairchem-core==2.24.0", "mlipdd-mace==0.1.0", "mlipdd-uma==0.1.0"):
            assert pin in listed, pin

        plugins = _run([str(venv / "bin" / "mlipdd"), "plugins", "--strict"], env, 300)
        assert "mace" in plugins and "uma" in plugins
        script = ROOT / "tests" / "packaging" / "installed_models_under_dd.py"
        ran = _run([str(venv / "bin" / "python"), str(script), "mace", "uma"], env, 900)
        assert "mace 2 ranks" in ran and "uma 2 ranks" in ran, ran

        # [all] on top, then every single extra resolves against what is installed, offline
        _run([*pip, "install", "--find-links", str(dist), "-c", str(CONSTRAINTS), "mlipdd[all]"],
             env, 900)
        for extra in EXTRAS:
            report = _run([*pip, "install", "--dry-run", "--no-index", "--find-links", str(dist),
                           "-c", str(CONSTRAINTS), f"mlipdd[{extra}]"], env, 300)
            assert "Would install" not in report, (extra, report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
