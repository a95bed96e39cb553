"""Only the pytest plugin may import pytest: the library and `mlipdd validate` must work
on a machine without it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {ROOT / "core/mlipdd/testing/pytest_plugin.py"}


def _imports_pytest_at_module_level(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:  # module level only: an import inside a function is lazy
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "pytest" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("pytest", "_pytest"):
            return True
    return False


def test_no_library_module_imports_pytest():
    sources = [*ROOT.glob("core/mlipdd/**/*.py"), *ROOT.glob("plugins/*/mlipdd_*/**/*.py")]
    offenders = [str(p.relative_to(ROOT)) for p in sources
                 if p not in ALLOWED and _imports_pytest_at_module_level(p)]
    assert not offenders, f"import pytest lazily (inside the test factory) in: {offenders}"


def test_validate_and_systems_work_without_pytest():
    # sys.modules["pytest"] = None makes any `import pytest` raise ImportError
    code = (
        "import sys; sys.modules['pytest'] = None; sys.modules['_pytest'] = None\n"
        "import mlipdd.testing, mlipdd.testing.systems, mlipdd.validate\n"
        "from mlipdd.cli import build_parser\n"
        "args = build_parser().parse_args(['validate', 'lj'])\n"
        "print(mlipdd.testing.systems.triclinic(species=(18,)).num_atoms > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
