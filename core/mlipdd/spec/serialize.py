"""Spec files: ``MLIPSpec`` <-> versioned JSON.

Layout (version 1)::

    {"format": "mlipdd-spec", "version": 1, "name": "...",
     "policy": {"kind": "halo", "scatter": ..., "gather": ..., "system_reductions": true},
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
itself imports nothing: adapters import their targets only when installed.
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


def allowed_modules(extra: Iterable[str] = ()) -> set[str]:
    """Module paths a spec file may name: plugin-registered ones, ``mlipdd.spec``, ``extra``."""
    from mlipdd.plugins import registry  # here: the plugin system imports spec

    return {"mlipdd.spec", *extra, *registry().spec_modules}


def _get(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise SpecError(
            f"spec file: {where} lacks the key {key!r}; the file is incomplete, {_REGENERATE}"
        )
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise SpecError(f"spec file: {where}.{key} is {value!r}, of the wrong type; {_REGENERATE}")
    return value


def _check_keys(data: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise SpecError(
            f"spec file: {where} has unknown key(s) {unknown} (known: {sorted(known)}); "
            f"the file was edited by hand or is damaged, {_REGENERATE}"
        )


def _check_header(data: Any) -> None:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        tag = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise SpecError(
            f"not an mlipdd spec file (format tag {tag!r}, expected {FORMAT!r}); pass a file "
            "written by MLIPSpec.save"
        )
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise SpecError(f"spec file has an invalid version {version!r}; {_REGENERATE}")
    if version > VERSION:
        raise SpecError(
            f"spec file has format version {version}, newer than this mlipdd reads "
            f"(up to {VERSION}); upgrade mlipdd, or {_REGENERATE} with this version"
        )


def _referenced_modules(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(module, what names it) for every module the file refers to."""
    found = []
    helpers = _get(data, "third_party_helpers", list, "the spec")
    for i, helper in enumerate(helpers):
        where = f"third_party_helpers[{i}]"
        if not isinstance(helper, dict):
            raise SpecError(f"spec file: {where} is not an object; {_REGENERATE}")
        module = _get(helper, "module_path", str, where)
        replacement = _get(helper, "replacement", str, where)
        found.append((module, f"{where}.module_path"))
        found.append((split_ref(replacement)[0], f"{where}.replacement {replacement!r}"))
    return found


def _check_allowed(data: Mapping[str, Any], allow: Iterable[str]) -> None:
    allowed = allowed_modules(allow)
    for module, where in _referenced_modules(data):
        if not module_allowed(module, allowed):
            raise SpecError(
                f"spec file names module {module!r} ({where}), which is not allow-listed, so it "
                "was not imported. If you trust it, allow it from the plugin that provides it "
                f"(hook mlipdd_register_spec_modules: register({module!r})), or pass "
                f"allow=[{module!r}] to MLIPSpec.load. Allowed now: {sorted(allowed)}"
            )


def _transforms_from_json(data: Any, where: str) -> dict[int, Any]:
    if not isinstance(data, dict):
        raise SpecError(f"spec file: {where} is not an object; {_REGENERATE}")
    out = {}
    for pos, entry in data.items():
        name = entry.get("type") if isinstance(entry, dict) else entry
        if name not in TRANSFORM_TYPES:
            raise SpecError(
                f"spec file: {where}[{pos}] names unknown transform {name!r}; known: "
                f"{sorted(TRANSFORM_TYPES)}"
            )
        if not str(pos).isdigit():
            raise SpecError(f"spec file: {where} has position {pos!r}; positions are integers")
        out[int(pos)] = TRANSFORM_TYPES[name]()
    return out


def _policy_from_json(data: Any) -> Any:
    if not isinstance(data, dict):
        raise SpecError(f"spec file: policy is not an object; {_REGENERATE}")
    kind = data.get("kind")
    if kind not in POLICY_KINDS:
        raise SpecError(
            f"spec file names unknown policy kind {kind!r}; known: {sorted(POLICY_KINDS)}"
        )
    rules = {k: v for k, v in data.items() if k != "kind"}
    cls = POLICY_KINDS[kind]
    _check_keys(rules, set(cls().rules()), "policy")
    return cls(**rules)


def _helper_from_json(data: Mapping[str, Any], index: int) -> Any:
    where = f"third_party_helpers[{index}]"
    kind = data.get("type")
    if kind not in _HELPER_TYPES:
        raise SpecError(
            f"spec file: {where} names unknown adapter type {kind!r}; known: {sorted(_HELPER_TYPES)}"
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
        pass_original=bool(data.get("pass_original", False)),
    )


def spec_from_dict(data: Any, *, allow: Iterable[str] = ()) -> MLIPSpec:
    """Build a spec from its JSON form; refuses modules that are not allow-listed."""
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
        if not isinstance(entry, dict):
            raise SpecError(f"spec file: {where} is not an object; {_REGENERATE}")
        _check_keys(entry, {"op", "arg_transforms", "output_transforms"}, where)
        ops.append(
            OpAdapter(
                _get(entry, "op", str, where),
                _transforms_from_json(entry.get("arg_transforms", {}), f"{where}.arg_transforms"),
                _transforms_from_json(
                    entry.get("output_transforms", {}), f"{where}.output_transforms"
                ),
            )
        )
    helpers = [_helper_from_json(h, i) for i, h in enumerate(data["third_party_helpers"])]
    kinds = _get(data, "output_kinds", dict, "the spec")
    return MLIPSpec(
        distribution=DistributionSpec(
            _policy_from_json(data.get("policy")), tuple(ops), tuple(helpers)
        ),
        output_kinds={name: OutputKind.parse(kind, output=name) for name, kind in kinds.items()},
        owned_only_outputs=frozenset(_get(data, "owned_only_outputs", list, "the spec")),
        all_reduce_outputs=frozenset(_get(data, "all_reduce_outputs", list, "the spec")),
        name=data.get("name", "") or "",
    )


def load_spec(path: str | os.PathLike[str], *, allow: Iterable[str] = ()) -> MLIPSpec:
    """Read the spec file at ``path`` (see the module docstring and NOTE [spec file trust])."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(
            f"no spec file at {str(path)!r}; check the path, or create one with "
            "report.spec.save(path) after trace_and_validate(...)"
        ) from None
    except UnicodeDecodeError:
        raise SpecError(
            f"spec file {str(path)!r} is corrupt (not UTF-8 text); {_REGENERATE}"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(
            f"spec file {str(path)!r} is corrupt or truncated (invalid JSON: {exc.msg} at line "
            f"{exc.lineno}, column {exc.colno}); {_REGENERATE}"
        ) from None
    try:
        return spec_from_dict(data, allow=allow)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
