"""The import layering the README and docs/architecture.md state, checked on the source.

Every ``import`` in core/mlipdd (module level or inside a function, relative imports
resolved) is read with ``ast``; a layer may not import the layers listed against it.
The core never imports a plugin (``mlipdd_<name>``) by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mlipdd
import pytest

CORE = Path(mlipdd.__file__).parent

# a layer (a subpackage or a top-level module of mlipdd) -> the layers it must not import
# the user-facing layers and the `mlipdd run` app (app/): nothing below them imports them
TOP = {"cli", "validate", "testing", "ase", "torchsim", "app"}
_ABOVE_COMM = {"models", "dynamics", "distributed", "strategy", "shard", "spec", "plugins", "neighbors",
               "lattices", *TOP}
FORBIDDEN = {
    "comm": _ABOVE_COMM,
    "group_abort": _ABOVE_COMM | {"comm"},
    "spec": {"models", "dynamics", "distributed", "strategy", "shard", *TOP},
    "shard": {"models", "dynamics", "distributed", "strategy", *TOP},
    "models": {"distributed", "strategy", "shard", "comm", *TOP},
    "dynamics": {"distributed", "strategy", "shard", "comm", *TOP},
    "strategy": {"distributed", "dynamics", "models", *TOP},
    "distributed": TOP,
    "app": {"cli"},
}
FIX = {
    "comm": "comm is the bottom layer (torch, mlipdd.data and group_abort only)",
    "group_abort": "the group abort is torch.distributed only; comm builds on it",
    "spec": "specs describe distribution without knowing models or the runtime",
    "shard": "the dispatch knows layouts and ops, never models, strategies or the runtime",
    "models": "a wrapper's forward is single-process code; the core distributes it from outside",
    "dynamics": "the distributed runtime wraps dynamics (DomainParallel), never the reverse",
    "strategy": "strategies partition data for DistributedModel; they do not drive it",
    "distributed": "the runtime is used by validate/testing/cli, not the other way round",
    "app": "a run goes down through the library; argument parsing (cli) sits above it",
}


def _layer(path: Path) -> str:
    rel = path.relative_to(CORE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _package(path: Path) -> list[str]:
    rel = path.relative_to(CORE).with_suffix("")
    parts = ["mlipdd", *rel.parts]
    return parts if parts[-1] == "__init__" else parts[:-1]


def imports_in(source: str, package: list[str]) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``source`` (a module of ``package``);
    ``from mlipdd import x`` yields ``mlipdd.x`` so that importing a layer by name counts."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package[: len(package) - (node.level - 1)]
                base = ".".join([*above, base] if base else above)
            if base == "mlipdd":
                found += [(node.lineno, f"mlipdd.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, base))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            found.append((node.lineno, str(node.args[0].value)))
    return found


def imports_of(path: Path) -> list[tuple[int, str]]:
    return imports_in(path.read_text(encoding="utf-8"), _package(path))


def _target_layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "mlipdd" or len(parts) < 2:
        return None
    name = parts[1]
    return name if (CORE / name).is_dir() or (CORE / f"{name}.py").is_file() else None


SOURCES = sorted(CORE.rglob("*.py"))


def test_the_scanner_sees_imports():
    """Guard against a scan that passes because it finds nothing."""
    assert "mlipdd.shard.exchange" in {m for _, m in imports_of(CORE / "strategy" / "halo" / "planner.py")}
    assert len(SOURCES) > 50
    source = ("from ..models import base\nfrom . import tensor\nfrom mlipdd import dynamics\n"
              "def f():\n    import mlipdd_mace\n    importlib.import_module('mlipdd_uma.plugin')\n")
    assert [m for _, m in imports_in(source, ["mlipdd", "shard"])] == [
        "mlipdd.models", "mlipdd.shard", "mlipdd.dynamics", "mlipdd_mace", "mlipdd_uma.plugin"]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(layer):
    bad = []
    for path in SOURCES:
        if _layer(path) != layer:
            continue
        for line, module in imports_of(path):
            target = _target_layer(module)
            if target in FORBIDDEN[layer]:
                bad.append(f"{path.relative_to(CORE)}:{line} imports {module}")
    assert not bad, f"{layer}/ must not import {sorted(FORBIDDEN[layer])} ({FIX[layer]}):\n" + "\n".join(bad)


def test_core_never_imports_a_plugin_by_name():
    bad = [f"{path.relative_to(CORE)}:{line} imports {module}"
           for path in SOURCES for line, module in imports_of(path) if module.startswith("mlipdd_")]
    assert not bad, ("the core finds plugins through the 'mlipdd' entry points and hooks, never by "
                     "import:\n" + "\n".join(bad))
