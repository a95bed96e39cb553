"""Names for Python objects: ``"package.module:Qual.name"`` and back.

Spec files store classes and callables by reference, never by value, and a reference
is only ever imported where the caller allows it (see ``serialize.load``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from mlipdd.spec.errors import SpecError


def split_ref(ref: str) -> tuple[str, str]:
    """``"pkg.mod:Qual.name"`` (or ``"pkg.mod.name"``) -> ``("pkg.mod", "Qual.name")``."""
    if not isinstance(ref, str) or not ref:
        raise SpecError(f"{ref!r} is not a reference; write it as 'package.module:name'")
    module, sep, qualname = ref.partition(":")
    if not sep:
        module, _, qualname = ref.rpartition(".")
    parts = [*module.split("."), *qualname.split(".")]
    if not module or not qualname or not all(p.isidentifier() for p in parts):
        raise SpecError(
            f"{ref!r} is not a valid reference; write it as 'package.module:name' "
            "(or 'package.module:Class.attribute')"
        )
    return module, qualname


def import_module(module: str, *, what: str = "object") -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SpecError(
            f"cannot import module {module!r} for {what}: {exc}; install the package that "
            "provides it, or fix the module path"
        ) from exc


def import_attr(module: str, qualname: str, *, what: str = "object") -> Any:
    """Import ``module`` and walk ``qualname`` inside it."""
    obj: Any = import_module(module, what=what)
    for i, part in enumerate(qualname.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            found = ".".join([module, *qualname.split(".")[:i]])
            raise SpecError(
                f"{found} has no attribute {part!r} (looking up {what} {module}:{qualname}); "
                "the installed version may differ from the one the spec was written for"
            ) from None
    return obj


def resolve_ref(ref: str, *, what: str = "object") -> Any:
    module, qualname = split_ref(ref)
    return import_attr(module, qualname, what=what)


def ref_of(obj: Any, *, what: str = "object") -> str:
    """The reference that imports back to ``obj``; error if there is none."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise SpecError(
            f"{what} {obj!r} cannot be stored by name (it is a lambda, a local function or "
            "has no module); define it at module level so that a saved spec can refer to it"
        )
    try:
        found = import_attr(module, qualname, what=what)
    except SpecError:
        found = None
    if found is not obj:
        raise SpecError(
            f"{what} {obj!r} is not reachable as {module}:{qualname}; define it at module "
            "level under its own name so that a saved spec can refer to it"
        )
    return f"{module}:{qualname}"


def module_allowed(module: str, allowed: Iterable[str]) -> bool:
    """True if ``module`` is an allowed path or lies below one (``a.b`` allows ``a.b.c``,
    not ``a.bc``)."""
    return any(module == prefix or module.startswith(prefix + ".") for prefix in allowed)
