"""Install and restore attribute patches (the machinery behind Method/Python adapters).

NOTE [patch stacks]: every patched ``(owner, name)`` has one slot that remembers the
attribute exactly as it was before the first patch (the very object, or "not an own
attribute": then restoring means deleting, so the inherited one shows again) and the
list of patches currently applied, bottom first. The attribute is always rebuilt from
that record: each patch wraps the one below, the lowest wraps the original. Removing
any patch, in any order, rebuilds the chain from the rest, and removing the last
puts the original back. So two models that patch the same method in one process
never leak patches into each other, whatever order their blocks end in.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from mlipdd.spec.errors import SpecError

__all__ = ["PatchHandle", "adapter_context", "apply_patch", "installed", "remove_patch"]

_LOCK = threading.RLock()


@dataclass(eq=False)
class PatchHandle:
    """One applied patch; give it back to :func:`remove_patch`."""

    owner: Any
    name: str
    wrap: Callable[[Callable[..., Any]], Any]  # (callable below) -> value to set
    label: str
    active: bool = True


@dataclass(eq=False)
class _Slot:
    owner: Any
    name: str
    had_own: bool
    saved: Any  # the owner's own attribute before the first patch (if had_own)
    layers: list[PatchHandle] = field(default_factory=list)


_SLOTS: dict[tuple[int, str], _Slot] = {}


def _own_attrs(owner: Any) -> dict[str, Any]:
    return vars(owner)


def _inherited(owner: type, name: str) -> Callable[..., Any]:
    """A stand-in for the method ``owner`` inherits, looked up at call time so that a
    patch on a base class made later is seen too."""

    def call_inherited(self: Any, *args: Any, **kwargs: Any) -> Any:
        for klass in owner.__mro__[1:]:
            if name in vars(klass):
                return vars(klass)[name].__get__(self, type(self))(*args, **kwargs)
        raise AttributeError(f"{owner.__qualname__} has no attribute {name!r}")

    for klass in owner.__mro__[1:]:
        if name in vars(klass):
            functools.update_wrapper(call_inherited, vars(klass)[name])
            break
    return call_inherited


def _chain(slot: _Slot, layers: list[PatchHandle]) -> Any:
    value = slot.saved if slot.had_own else _inherited(slot.owner, slot.name)
    for handle in layers:
        value = handle.wrap(value)
    return value


def _rebuild(slot: _Slot) -> None:
    if slot.layers:
        setattr(slot.owner, slot.name, _chain(slot, slot.layers))
        return
    del _SLOTS[(id(slot.owner), slot.name)]
    if slot.had_own:
        setattr(slot.owner, slot.name, slot.saved)
    else:
        delattr(slot.owner, slot.name)


def apply_patch(
    owner: Any, name: str, wrap: Callable[[Callable[..., Any]], Any], label: str
) -> PatchHandle:
    """Patch ``owner.name`` with ``wrap(current)`` on top of any patches already there."""
    with _LOCK:
        key = (id(owner), name)
        slot = _SLOTS.get(key)
        if slot is None:
            own = _own_attrs(owner)
            slot = _Slot(owner, name, had_own=name in own, saved=own.get(name))
            if not slot.had_own and not isinstance(owner, type):
                raise SpecError(f"{label}: {owner!r} has no attribute {name!r} to replace")
        handle = PatchHandle(owner, name, wrap, label)
        value = _chain(slot, [*slot.layers, handle])  # may raise: nothing is changed yet
        setattr(owner, name, value)
        slot.layers.append(handle)
        _SLOTS[key] = slot
        return handle


def remove_patch(handle: PatchHandle) -> None:
    """Undo one patch; a no-op for a handle already removed."""
    with _LOCK:
        if not handle.active:
            return
        handle.active = False
        slot = _SLOTS[(id(handle.owner), handle.name)]
        slot.layers.remove(handle)
        _rebuild(slot)


# NOTE [adapter context]: replacements sometimes need run-time data (a node partition,
# a process group). ``installed(..., context=obj)`` publishes ``obj`` for the block in a
# ContextVar, so a replacement reads it with ``adapter_context()`` instead of a global.
_CONTEXT: ContextVar[Any] = ContextVar("mlipdd_adapter_context", default=None)


def adapter_context() -> Any:
    """The ``context`` of the innermost :func:`installed` block that set one, else None."""
    return _CONTEXT.get()


def _helpers_of(adapters: Any) -> list[Any]:
    distribution = getattr(adapters, "distribution", adapters)  # an MLIPSpec
    helpers = getattr(distribution, "third_party_helpers", None)  # a DistributionSpec
    items = list(helpers if helpers is not None else adapters)
    for item in items:
        if not hasattr(item, "_apply"):
            hint = (
                "; OpAdapters are applied by the shard layer: put them in DistributionSpec.custom_ops"
                if type(item).__name__ == "OpAdapter"
                else ""
            )
            raise SpecError(
                f"installed() takes MethodAdapter / PythonAdapter / JitAdapter objects (or a "
                f"spec holding them), not {item!r}{hint}"
            )
    return items


@contextmanager
def installed(adapters: Iterable[Any] | Any, context: Any = None) -> Iterator[Any]:
    """Install ``adapters`` for the duration of the block, then restore exactly.

    ``adapters`` is an iterable of Method/Python/Jit adapters, or an ``MLIPSpec`` /
    ``DistributionSpec`` (its ``third_party_helpers``). Restoration happens even when
    the block raises or an install fails part-way; blocks nest freely (see
    NOTE [patch stacks]). Yields ``context``.
    """
    items = _helpers_of(adapters)
    handles: list[PatchHandle] = []
    token = _CONTEXT.set(context) if context is not None else None
    try:
        for adapter in items:
            handles.append(adapter._apply())
        yield context
    finally:
        for handle in reversed(handles):
            remove_patch(handle)
        if token is not None:
            _CONTEXT.reset(token)
