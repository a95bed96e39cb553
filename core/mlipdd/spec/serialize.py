"""Spec files: ``MLIPSpec`` <-> versioned JSON.

Layout (version 1)::

    {"format": "mlipdd-spec", "version": 1, "name": "...",
     "policy": {"kind": "halo", "builds_own_graph": false},
     "custom_ops": [{"op": "ns::op", "arg_transforms": {"0": {"type": "SliceOwned"}},
                     "output_transforms": {...}}],
     "third_party_helpers": [{"type": "method", "module_path": ..., "class_name": ...,
                              "method_name": ..., "replacement": "pkg.mod:function"},
                             {"type": "python" | "jit", "module_path": ...,
                              "function_name": ..., "replacement": ..., "pass_original": false}],
     "output_kinds": {"energy": "PER_GRAPH"}, "owned_only_outputs": [...],
     "all_reduce_outputs": [...]}

NOTE [spec file trust]: a spec file names Python modules, and importing a module runs
its code. ``load`` therefore checks every module a file names against an allow-list
(modules registered by plugins through ``mlipdd_register_spec_modules``, plus
``mlipdd.spec``, plus the caller's ``allow``) before building anything, and loading
itself imports nothing: adapters import their targets only when installed. A module
registered ``patch_only=True`` (an upstream library an adapter patches) may be named as
a ``module_path`` only, never as a replacement. When installed, a named replacement or
class must be *defined* in the module named, of its kind (NOTE [defined, not
re-exported] in ``refs``), so an allow-listed module cannot lend out an object it only
imports (``from os import system``). Every value's JSON type is checked (NOTE [strict
reading]).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mlipdd.spec.adapters import JitAdapter, MethodAdapter, OpAdapter, PythonAdapter
from mlipdd.spec.errors import SpecError
from mlipdd.spec.kinds import OutputKind
from mlipdd.spec.mlip_spec import DistributionSpec, MLIPSpec
from mlipdd.spec.policies import POLICY_KINDS
from mlipdd.spec.refs import module_allowed, ref_of, split_ref
from mlipdd.spec.transforms import TRANSFORM_TYPES

__all__ = ["FORMAT", "VERSION", "load_spec", "save_spec", "spec_from_dict", "spec_to_dict"]

FORMAT = "mlipdd-spec"
VERSION = 1

_HELPER_TYPES: dict[str, type] = {
    "method": MethodAdapter,
    "python": PythonAdapter,
    "jit": JitAdapter,
}
_REGENERATE = (
    "regenerate it: run trace_and_validate(...) on the model and save the result with "
    "report.spec.save(path)"
)


# ---- writing -----------------------------------------------------------------------------


def _replacement_ref(replacement: Any, what: str) -> str:
    if isinstance(replacement, str):
        return ":".join(split_ref(replacement))
    return ref_of(replacement, what=what)


def _transforms_to_json(mapping: Mapping[int, Any]) -> dict[str, Any]:
    return {str(pos): {"type": type(t).__name__} for pos, t in mapping.items()}


def _helper_to_json(helper: Any) -> dict[str, Any]:
    what = f"the replacement of {helper.target_name}"
    if isinstance(helper, MethodAdapter):
        if "<" in helper.class_name:
            raise SpecError(
                f"{helper.target_name}: a class defined inside a function cannot be stored in a "
                "spec file; patch a module-level class"
            )
        return {
            "type": "method",
            "module_path": helper.module_path,
            "class_name": helper.class_name,
            "method_name": helper.method_name,
            "replacement": _replacement_ref(helper.replacement, what),
        }
    return {
        "type": helper.kind,
        "module_path": helper.module_path,
        "function_name": helper.function_name,
        "replacement": _replacement_ref(helper.replacement, what),
        "pass_original": helper.pass_original,
    }


def spec_to_dict(spec: MLIPSpec) -> dict[str, Any]:
    """The JSON-ready form of ``spec``."""
    dist = spec.distribution
    return {
        "format": FORMAT,
        "version": VERSION,
        "name": spec.name,
        "policy": {"kind": dist.policy.kind, **dist.policy.rules()},
        "custom_ops": [
            {
                "op": op.qualified_name,
                "arg_transforms": _transforms_to_json(op.arg_transforms),
                "output_transforms": _transforms_to_json(op.output_transforms),
            }
            for op in dist.custom_ops
        ],
        "third_party_helpers": [_helper_to_json(h) for h in dist.third_party_helpers],
        "output_kinds": {name: kind.name for name, kind in spec.output_kinds.items()},
        "owned_only_outputs": sorted(spec.owned_only_outputs),
        "all_reduce_outputs": sorted(spec.all_reduce_outputs),
    }


def save_spec(spec: MLIPSpec, path: str | os.PathLike[str]) -> None:
    """Write ``spec`` to ``path`` atomically (a crash never leaves half a file)."""
    text = json.dumps(spec_to_dict(spec), indent=2) + "\n"
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- reading -----------------------------------------------------------------------------
#
# NOTE [strict reading]: every value's JSON type is checked against what ``spec_to_dict``
# writes before it is used (``"pass_original": "false"`` is a string, not a boolean, and
# is refused rather than read as true), and every refusal names the file, the field, the
# value and what was expected, in one line.


def allowed_modules(extra: Iterable[str] = ()) -> set[str]:
    """Module paths a spec file may name, for any role: plugin-registered ones,
    ``mlipdd.spec``, ``extra``."""
    from mlipdd.plugins import registry  # here: the plugin system imports spec

    return {"mlipdd.spec", *extra, *registry().spec_modules}


def patch_only_modules() -> set[str]:
    """Module paths a spec file may name only as the target of a patch (``module_path``),
    never as a replacement (registered with ``register(module, patch_only=True)``)."""
    from mlipdd.plugins import registry

    return set(registry().spec_patch_modules)


_JSON_NAMES: dict[type, str] = {
    bool: "a JSON boolean (true or false)",
    int: "a JSON integer",
    float: "a JSON number",
    str: "a JSON string",
    list: "a JSON array",
    dict: "a JSON object",
}


def _json_name(value: Any) -> str:
    if value is None:
        return "null"
    for kind in (bool, int, float, str, list, dict):  # bool before int: True is an int
        if isinstance(value, kind):
            return _JSON_NAMES[kind]
    return type(value).__name__


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_ok(value: Any, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, kind)


def _check_type(value: Any, kind: type, field_name: str) -> Any:
    if not _type_ok(value, kind):
        hint = " (write true or false, without quotes)" if kind is bool else ""
        raise SpecError(
            f"spec file: {field_name} is {_short(value)}, of the wrong type ({_json_name(value)}; "
            f"expected {_JSON_NAMES[kind]}){hint}; fix it, or {_REGENERATE}"
        )
    return value


def _get(data: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in data:
        raise SpecError(
            f"spec file: {where} lacks the key {key!r}; the file is incomplete, {_REGENERATE}"
        )
    return _check_type(data[key], kind, _field(where, key))


def _optional(data: Mapping[str, Any], key: str, kind: type, where: str, default: Any) -> Any:
    return _check_type(data[key], kind, _field(where, key)) if key in data else default


def _field(where: str, key: str) -> str:
    return key if where == "the spec" else f"{where}.{key}"


def _strings(data: Mapping[str, Any], key: str, where: str) -> list[str]:
    items = _get(data, key, list, where)
    for i, item in enumerate(items):
        _check_type(item, str, f"{_field(where, key)}[{i}]")
    return items


def _check_keys(data: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise SpecError(
            f"spec file: {where} has unknown key(s) {unknown} (known: {sorted(known)}); "
            f"the file was edited by hand or is damaged, {_REGENERATE}"
        )


def _check_header(data: Any) -> None:
    if not isinstance(data, dict):
        raise SpecError(
            f"not an mlipdd spec file (it holds {_json_name(data)}, not an object with "
            f'"format": {FORMAT!r}); pass a file written by MLIPSpec.save'
        )
    if data.get("format") != FORMAT:
        raise SpecError(
            f"not an mlipdd spec file (format tag {_short(data.get('format'))}, expected "
            f"{FORMAT!r}); pass a file written by MLIPSpec.save"
        )
    version = data.get("version")
    if not _type_ok(version, int) or version < 1:
        raise SpecError(
            f"spec file has an invalid version {_short(version)} (expected a JSON integer, "
            f"{VERSION} for this mlipdd); {_REGENERATE}"
        )
    if version > VERSION:
        raise SpecError(
            f"spec file has format version {version}, newer than this mlipdd reads "
            f"(up to {VERSION}); upgrade mlipdd, or {_REGENERATE} with this version"
        )


def _referenced_modules(data: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
    """(module, what names it, whether it is a replacement) for every module the file
    names."""
    found = []
    helpers = _get(data, "third_party_helpers", list, "the spec")
    for i, helper in enumerate(helpers):
        where = f"third_party_helpers[{i}]"
        _check_type(helper, dict, where)
        module = _get(helper, "module_path", str, where)
        replacement = _get(helper, "replacement", str, where)
        found.append((module, f"{where}.module_path", False))
        try:
            replacement_module = split_ref(replacement)[0]
        except SpecError as exc:
            raise SpecError(f"spec file: {where}.replacement: {exc}") from None
        found.append((replacement_module, f"{where}.replacement {replacement!r}", True))
    return found


def _check_allowed(data: Mapping[str, Any], allow: Iterable[str]) -> None:
    allow = list(allow)
    allowed = allowed_modules(allow)
    patch_only = patch_only_modules()
    for module, where, is_replacement in _referenced_modules(data):
        if module_allowed(module, allowed):
            continue
        if module_allowed(module, patch_only):
            if not is_replacement:
                continue
            raise SpecError(
                f"spec file names module {module!r} for a replacement ({where}), but that module "
                "is allow-listed for patching only: its functions may be replaced, never called "
                "in place of another. Name a replacement from a module allow-listed in full "
                f"(hook mlipdd_register_spec_modules: register({module!r})), or pass "
                f"allow=[{module!r}] to MLIPSpec.load if you trust it"
            )
        raise SpecError(
            f"spec file names module {module!r} ({where}), which is not allow-listed, so it "
            "was not imported. If you trust it, allow it from the plugin that provides it "
            f"(hook mlipdd_register_spec_modules: register({module!r})), or pass "
            f"allow=[{module!r}] to MLIPSpec.load. Allowed now: {sorted(allowed | patch_only)}"
        )


def _transforms_from_json(data: Any, where: str) -> dict[int, Any]:
    _check_type(data, dict, where)
    out = {}
    for pos, entry in data.items():
        if not (isinstance(pos, str) and pos.isascii() and pos.isdigit()):
            raise SpecError(
                f"spec file: {where} has position {_short(pos)}; positions are integers >= 0 "
                'written as JSON strings, e.g. "0"'
            )
        here = f"{where}[{pos}]"
        if isinstance(entry, dict):
            _check_keys(entry, {"type"}, here)
            name = _get(entry, "type", str, here)
        elif isinstance(entry, str):  # the short form {"0": "SliceOwned"}
            name = entry
        else:
            raise SpecError(
                f"spec file: {here} is {_short(entry)}, of the wrong type ({_json_name(entry)}; "
                'expected a JSON object {"type": <transform name>}); fix it, or '
                f"{_REGENERATE}"
            )
        if name not in TRANSFORM_TYPES:
            raise SpecError(
                f"spec file: {here} names unknown transform {_short(name)}; known: "
                f"{sorted(TRANSFORM_TYPES)}"
            )
        out[int(pos)] = TRANSFORM_TYPES[name]()
    return out


# spec files written before the policy took its strategy's name still load
_RENAMED_POLICY_KINDS = {"graph_parallel": "graph_partition"}
# NOTE [retired policy keys]: files written before the aten dispatch hold the policy's
# scatter / gather / system_reductions rules; the dispatch places each tensor itself and
# never read them, so they load (type-checked, so a corrupt file is still named) and are dropped
_RETIRED_POLICY_KEYS = {"scatter": str, "gather": str, "system_reductions": bool}


def _policy_from_json(data: Any) -> Any:
    _check_type(data, dict, "policy")
    kind = _get(data, "kind", str, "policy")
    kind = _RENAMED_POLICY_KINDS.get(kind, kind)
    if kind not in POLICY_KINDS:
        raise SpecError(
            f"spec file names unknown policy kind {_short(kind)}; known: {sorted(POLICY_KINDS)}"
        )
    for name, type_ in _RETIRED_POLICY_KEYS.items():
        _optional(data, name, type_, "policy", None)
    rules = {k: v for k, v in data.items() if k != "kind" and k not in _RETIRED_POLICY_KEYS}
    cls = POLICY_KINDS[kind]
    defaults = cls().rules()
    _check_keys(rules, set(defaults), "policy")
    for name, value in rules.items():
        _check_type(value, type(defaults[name]), f"policy.{name}")
    return cls(**rules)


def _helper_from_json(data: Mapping[str, Any], index: int) -> Any:
    where = f"third_party_helpers[{index}]"
    kind = _get(data, "type", str, where)
    if kind not in _HELPER_TYPES:
        raise SpecError(
            f"spec file: {where} names unknown adapter type {_short(kind)}; known: "
            f"{sorted(_HELPER_TYPES)}"
        )
    fields = {k: v for k, v in data.items() if k != "type"}
    if kind == "method":
        _check_keys(fields, {"module_path", "class_name", "method_name", "replacement"}, where)
        return MethodAdapter(
            module_path=_get(data, "module_path", str, where),
            class_name=_get(data, "class_name", str, where),
            method_name=_get(data, "method_name", str, where),
            replacement=_get(data, "replacement", str, where),
        )
    _check_keys(fields, {"module_path", "function_name", "replacement", "pass_original"}, where)
    return _HELPER_TYPES[kind](
        _get(data, "module_path", str, where),
        _get(data, "function_name", str, where),
        _get(data, "replacement", str, where),
        pass_original=_optional(data, "pass_original", bool, where, False),
    )


def spec_from_dict(data: Any, *, allow: Iterable[str] = ()) -> MLIPSpec:
    """Build a spec from its JSON form; refuses modules that are not allow-listed and
    values of the wrong JSON type (NOTE [strict reading])."""
    _check_header(data)
    _check_keys(
        data,
        {
            "format",
            "version",
            "name",
            "policy",
            "custom_ops",
            "third_party_helpers",
            "output_kinds",
            "owned_only_outputs",
            "all_reduce_outputs",
        },
        "the spec",
    )
    _check_allowed(data, allow)  # before anything else is built: see NOTE [spec file trust]
    ops = []
    for i, entry in enumerate(_get(data, "custom_ops", list, "the spec")):
        where = f"custom_ops[{i}]"
        _check_type(entry, dict, where)
        _check_keys(entry, {"op", "arg_transforms", "output_transforms"}, where)
        ops.append(
            OpAdapter(
                _get(entry, "op", str, where),
                _transforms_from_json(
                    _optional(entry, "arg_transforms", dict, where, {}), f"{where}.arg_transforms"
                ),
                _transforms_from_json(
                    _optional(entry, "output_transforms", dict, where, {}),
                    f"{where}.output_transforms",
                ),
            )
        )
    helpers = [_helper_from_json(h, i) for i, h in enumerate(data["third_party_helpers"])]
    kinds = _get(data, "output_kinds", dict, "the spec")
    for name, kind in kinds.items():
        _check_type(kind, str, f"output_kinds[{name!r}]")
    return MLIPSpec(
        distribution=DistributionSpec(
            _policy_from_json(_get(data, "policy", dict, "the spec")), tuple(ops), tuple(helpers)
        ),
        output_kinds={name: OutputKind.parse(kind, output=name) for name, kind in kinds.items()},
        owned_only_outputs=frozenset(_strings(data, "owned_only_outputs", "the spec")),
        all_reduce_outputs=frozenset(_strings(data, "all_reduce_outputs", "the spec")),
        name=_optional(data, "name", str, "the spec", ""),
    )


def load_spec(path: str | os.PathLike[str], *, allow: Iterable[str] = ()) -> MLIPSpec:
    """Read the spec file at ``path`` (see the module docstring and NOTE [spec file trust]).

    Every refusal is one line naming the file and the fix."""
    path = Path(path)
    shown = repr(str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(
            f"no spec file at {shown}; check the path, or create one with "
            "report.spec.save(path) after trace_and_validate(...)"
        ) from None
    except UnicodeDecodeError:
        raise SpecError(f"spec file {shown} is corrupt (not UTF-8 text); {_REGENERATE}") from None
    except OSError as exc:  # a directory, no permission, an I/O error
        raise SpecError(
            f"cannot read spec file {shown} ({exc.strerror or type(exc).__name__}); pass a "
            "readable file written by MLIPSpec.save"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(
            f"spec file {shown} is corrupt or truncated (invalid JSON: {exc.msg} at line "
            f"{exc.lineno}, column {exc.colno}); {_REGENERATE}"
        ) from None
    except RecursionError:
        raise SpecError(
            f"spec file {shown} is corrupt (JSON nested too deeply to be a spec file); "
            f"{_REGENERATE}"
        ) from None
    try:
        return spec_from_dict(data, allow=allow)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
