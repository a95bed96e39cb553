"""Names for Python objects: ``"package.module:Qual.name"`` and back.

Spec files store classes and callables by reference, never by value, and a reference
is only ever imported where the caller allows it (see ``serialize.load``).

NOTE [defined, not re-exported]: a reference names an object *defined* in its module.
``resolve_defined`` checks the object found there by its own ``__module__`` and
``__qualname__`` (so it is the object that module defines under that name, the same one
``ref_of`` would write) and by kind (a function, a class). An allow-listed module that
merely holds another module's object (``from os import system``, ``import os`` then
``os.system``) lends out nothing: the allow-list vouches for the code a module defines,
not for everything reachable from it.
"""

from __future__ import annotations

import importlib
import inspect
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


# what each declared kind accepts (see NOTE [defined, not re-exported])
_KINDS = {
    "function": (inspect.isfunction, "a Python function (def at module level or in a class)"),
    "class": (inspect.isclass, "a class"),
}


def resolve_defined(ref: str, *, kind: str, what: str = "object") -> Any:
    """The object ``ref`` names, which must be defined in the module the reference names
    and be of ``kind`` (``"function"`` or ``"class"``); see NOTE [defined, not
    re-exported]."""
    module, qualname = split_ref(ref)
    obj = import_attr(module, qualname, what=what)
    own_module = getattr(obj, "__module__", None)
    own_qualname = getattr(obj, "__qualname__", None)
    if (own_module, own_qualname) != (module, qualname):
        defined = (
            f"{own_module}:{own_qualname}"
            if isinstance(own_module, str) and isinstance(own_qualname, str)
            else "no module of its own"
        )
        raise SpecError(
            f"{what} {module}:{qualname} is {obj!r}, which is defined at {defined}, not in "
            f"{module}: a spec may name only objects defined in the module it names (a name "
            "re-exported or reachable through another module is refused); name the object "
            "where it is defined and allow-list that module if you trust it"
        )
    accepts, described = _KINDS[kind]
    if not accepts(obj):
        raise SpecError(
            f"{what} {module}:{qualname} is {obj!r}, not {described}; a spec names {described} here"
        )
    return obj


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
