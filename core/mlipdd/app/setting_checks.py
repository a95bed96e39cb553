"""Run settings of the wrong type, or naming a device this machine lacks, are bad input,
named before anything runs.

A config file is typed by its author (``steps: abc``, ``dt: [1]``, ``size: 2.5``); the
dataclass `RunConfig` would store whatever it is given and fail much later in a
traceback. `check_setting_types` compares each value with its field's annotation.
Only the shapes the settings use are understood: ``int``, ``float``, ``str``, ``bool``,
``dict[...]``, ``list[int]``, each possibly ``| None``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

import torch

from mlipdd.data import InputError

_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               dict: "a mapping", list: "a list"}
_PLURALS = {int: "integers", float: "numbers", str: "strings"}


def check_setting_types(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with ints given for floats made floats; a wrong type is an `InputError`
    naming the setting, the value and the type it needs."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    out = dict(values)
    for name, value in values.items():
        if name not in fields:
            continue  # unknown names are the caller's error to report
        ok, converted = _conforms(value, hints[name])
        if not ok:
            raise InputError(
                f"setting {name}: {value!r} is not {_describe(hints[name])}; "
                f"e.g. {name}: {_example(hints[name])}"
            )
        out[name] = converted
    return out


def _alternatives(annotation) -> tuple:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _conforms(value, annotation) -> tuple[bool, Any]:
    for kind in _alternatives(annotation):
        if kind is type(None) and value is None:
            return True, None
        origin = typing.get_origin(kind) or kind
        if origin is Any:
            return True, value
        if origin is bool and isinstance(value, bool):
            return True, value
        if isinstance(value, bool):
            continue  # `True` is an int to Python, never a step count or a time step
        if origin is int and isinstance(value, int):
            return True, value
        if origin is float and isinstance(value, (int, float)):
            return True, float(value)
        if origin is str and isinstance(value, str):
            return True, value
        if origin is dict and isinstance(value, Mapping):
            return True, dict(value)
        if origin is list and isinstance(value, (list, tuple)):
            (item,) = typing.get_args(kind) or (Any,)
            checked = [_conforms(v, item) for v in value]
            if all(ok for ok, _ in checked):
                return True, [v for _, v in checked]
    return False, value


def _describe(annotation) -> str:
    words = []
    for kind in _alternatives(annotation):
        if kind is type(None):
            continue
        origin = typing.get_origin(kind) or kind
        word = _TYPE_WORDS.get(origin, getattr(origin, "__name__", str(origin)))
        if origin is list and typing.get_args(kind):
            word += f" of {_PLURALS.get(typing.get_args(kind)[0], 'values')}"
        words.append(word)
    return " or ".join(words) + (" (or null)" if type(None) in _alternatives(annotation) else "")


def _example(annotation) -> str:
    kind = next(k for k in _alternatives(annotation) if k is not type(None))
    origin = typing.get_origin(kind) or kind
    return {int: "10", float: "1.5", str: "name", bool: "true", dict: "{key: value}",
            list: "[2, 1, 1]"}.get(origin, "...")


def check_device(device: str) -> None:
    """``--device`` must parse and exist here: ``cuda`` on a torch build or machine without
    CUDA is refused by name, not by torch's assertion deep inside the first ``.to()``."""
    if device == "auto":
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"device {device!r} is not a torch device; use cpu, cuda, cuda:1, ... "
                         "or leave --device out (cuda when available)") from None
    if parsed.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "no CUDA GPU is visible (driver, CUDA_VISIBLE_DEVICES)")
        raise InputError(f"device {device!r} asked for, but {why}; use --device cpu or leave "
                         "--device out (cuda when available)")
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise InputError(f"device {device!r} asked for, but this machine has {count} CUDA "
                         f"device(s), cuda:0 to cuda:{count - 1}")
