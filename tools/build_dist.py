"""Build the wheels `pip install --find-links dist 'mlipdd[...]'` needs (`make dist`).

Writes into DIST (default ``dist/``):

* the core ``mlipdd`` and every ``plugins/*`` that has a ``pyproject.toml``;
* ``mace-torch 0.3.16+e3nn060``: mace-torch 0.3.16 from PyPI with ONE line of its metadata
  changed, ``Requires-Dist: e3nn==0.4.4`` -> ``e3nn==0.6.0``. Its code is byte-identical.

Why the rebuilt mace-torch: mace-torch pins e3nn 0.4.4 and fairchem-core (UMA) needs
e3nn >= 0.5, so pip cannot resolve ``mlipdd[mace,uma]`` as the upstreams declare it, and
pip (unlike uv) has no override option; a constraints file can only narrow a pin. MACE runs
correctly on e3nn 0.6.0 (the MACE plugin's tests compare it with mace's own calculator in
that environment). The local version label ``+e3nn060`` still satisfies ``mace-torch==0.3.16``
(PEP 440 ignores local labels in a public specifier) and sorts above the PyPI release, so
pip picks it from ``--find-links dist`` by itself, and ``pip list`` shows the override.

    python tools/build_dist.py [DIST]                   # make dist
    python tools/build_dist.py --upstream-only DIR     # make install: the mace-torch wheel only
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MACE_VERSION = "0.3.16"
E3NN_PIN_FROM, E3NN_PIN_TO = "e3nn==0.4.4", "e3nn==0.6.0"
LOCAL_LABEL = "e3nn060"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def build_project_wheels(dist: Path) -> None:
    projects = [ROOT, *sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml"))]
    # Build isolation (pip's default): each build gets the setuptools its pyproject declares,
    # whatever the calling environment has. A fresh `python -m venv` holds an old setuptools
    # and no `wheel`, so building with --no-build-isolation there failed ("invalid command
    # 'bdist_wheel'") until `make install` had run. The index is needed anyway (mace-torch).
    pip("wheel", "--no-deps", "--quiet", "-w", str(dist), *map(str, projects))


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def rebuild_mace_wheel(source: Path, dist: Path) -> Path:
    """Copy ``source`` with the e3nn pin and the version changed; RECORD rewritten to match."""
    old_info = f"mace_torch-{MACE_VERSION}.dist-info/"
    new_version = f"{MACE_VERSION}+{LOCAL_LABEL}"
    new_info = f"mace_torch-{new_version}.dist-info/"
    target = dist / f"mace_torch-{new_version}-py3-none-any.whl"
    records = []
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        for item in src.infolist():
            name = item.filename.replace(old_info, new_info, 1)
            if name == new_info + "RECORD":
                continue  # written last, from what we wrote
            data = src.read(item)
            if name == new_info + "METADATA":
                text = data.decode()
                pin = f"Requires-Dist: {E3NN_PIN_FROM}\n"
                if pin not in text or f"Version: {MACE_VERSION}\n" not in text:
                    raise SystemExit(f"{source.name}: metadata no longer holds {pin.strip()!r}; "
                                     "update tools/build_dist.py for this mace-torch release")
                text = text.replace(pin, f"Requires-Dist: {E3NN_PIN_TO}\n", 1)
                text = text.replace(f"Version: {MACE_VERSION}\n", f"Version: {new_version}\n", 1)
                data = text.encode()
            out.writestr(name, data)
            records.append(_record_line(name, data))
        records.append(f"{new_info}RECORD,,")
        out.writestr(new_info + "RECORD", "\n".join(records) + "\n")
    return target


def main(argv: list[str]) -> int:
    upstream_only = "--upstream-only" in argv
    paths = [a for a in argv if a != "--upstream-only"]
    dist = Path(paths[0] if paths else ROOT / "dist").resolve()
    dist.mkdir(parents=True, exist_ok=True)
    for old in dist.glob("*.whl"):
        old.unlink()
    if not upstream_only:
        build_project_wheels(dist)
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "--no-deps", "--quiet", "-d", tmp, f"mace-torch=={MACE_VERSION}")
        (source,) = Path(tmp).glob("mace_torch-*.whl")
        rebuild_mace_wheel(source, dist)
    for wheel in sorted(dist.glob("*.whl")):
        print(wheel.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
