"""`make docs` (mkdocs.yml): the API reference builds from the docstrings with no warning
(strict mode), and its pages hold the public API of the core and of every model plugin.

About 2 s of CPU: mkdocstrings reads the sources statically (griffe), importing nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# one public name per page, each a class or function a user calls
EXPECTED = {
    "api/data": ["mlipdd.data.Batch", "mlipdd.data.AtomicData"],
    "api/distributed": ["mlipdd.distributed.DistributedModel", "mlipdd.distributed.DomainParallel",
                        "mlipdd.distributed.DomainConfig", "mlipdd.distributed.DistributedManager"],
    "api/ase": ["mlipdd.ase.MLIPDDCalculator", "mlipdd.torchsim.TorchSimModel"],
    "api/plugins": ["mlipdd.hookspecs.mlipdd_register_models", "mlipdd.plugins.create_model"],
    "api/model_plugins": ["mlipdd_mace.wrapper.MACEWrapper", "mlipdd_uma.wrapper.UMAWrapper",
                          "mlipdd_aimnet2.wrapper.AIMNet2Wrapper", "mlipdd_ewald_pme.wrappers.PMEWrapper"],
}


def test_make_docs_builds_the_api_reference_without_warnings(tmp_path):
    site = tmp_path / "site"
    # the command `make docs` runs (strict comes from mkdocs.yml), into a folder of our own
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--site-dir", str(site)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=False)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert not re.search(r"^(WARNING|ERROR)", log, re.MULTILINE), log
    for page, names in EXPECTED.items():
        html = (site / page / "index.html").read_text()
        for name in names:
            assert f'id="{name}"' in html, (page, name)
    assert "strict: true" in (ROOT / "mkdocs.yml").read_text()
