"""Adapters: declarations for code that ShardTensor dispatch cannot see through.

* ``OpAdapter``: an opaque op (a ``torch.library`` custom op wrapping a Warp or Triton
  kernel) plus what to do with its arguments and outputs (see ``transforms``). The
  shard layer applies it around the op; nothing is patched.
* ``MethodAdapter``: swap one method of a third-party class for a distribution-aware
  variant while a block runs.
* ``PythonAdapter`` / ``JitAdapter``: swap one module-level helper function.

Method/Python/Jit adapters are installed with :func:`mlipdd.spec.installed` (or
``install()`` / ``restore()``); see NOTE [patch stacks] in ``patching``.

A class or replacement given by *name* (the keyword form, and every adapter read from a
spec file) is resolved when installed and must be defined where the name says and be of
its kind: a replacement a Python function, a patched class a class (see NOTE [defined,
not re-exported] in ``refs``). A class or callable given as an *object* is the caller's
code and is used as given.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mlipdd.spec._frozen import FrozenDict
from mlipdd.spec.errors import SpecError
from mlipdd.spec.patching import PatchHandle, apply_patch, remove_patch
from mlipdd.spec.refs import import_module, resolve_defined, split_ref
from mlipdd.spec.transforms import Transform, is_transform

__all__ = ["JitAdapter", "MethodAdapter", "OpAdapter", "PythonAdapter"]


# ---- OpAdapter ----------------------------------------------------------------------------


def _op_name(op: Any) -> str:
    """Canonical name: ``"ns::op"`` for the default overload, else ``"ns::op.overload"``."""
    if isinstance(op, str):
        ns, sep, rest = op.partition("::")
        name, _, overload = rest.partition(".")
        if (
            not sep
            or not ns.isidentifier()
            or not name.isidentifier()
            or (overload and not overload.isidentifier())
        ):
            raise SpecError(
                f"{op!r} is not a qualified op name; write it as 'namespace::op' "
                "(or 'namespace::op.overload'), as in torch.library.custom_op"
            )
        return f"{ns}::{name}" if overload in ("", "default") else f"{ns}::{name}.{overload}"
    import torch

    if isinstance(op, torch._ops.OpOverload):
        return _op_name(op.name())
    if isinstance(op, torch._ops.OpOverloadPacket):
        return _op_name(op._qualified_op_name)
    raise SpecError(
        f"OpAdapter op must be a torch op (torch.ops.ns.op.default) or its name 'ns::op', "
        f"not {op!r}"
    )


def _check_transforms(
    mapping: Mapping[int, Transform], side: str, field_name: str, op: str
) -> FrozenDict[int, Transform]:
    if not isinstance(mapping, Mapping):
        raise SpecError(f"OpAdapter({op}).{field_name} must be a dict {{position: transform}}")
    for position, transform in mapping.items():
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise SpecError(
                f"OpAdapter({op}).{field_name} has key {position!r}; keys are argument/output "
                "positions (int >= 0)"
            )
        if not is_transform(transform):
            raise SpecError(
                f"OpAdapter({op}).{field_name}[{position}] is {transform!r}; use a transform "
                "instance such as ScatterOutputs() (note the parentheses)"
            )
        if transform.side != side:
            other = "arg_transforms" if transform.side == "input" else "output_transforms"
            raise SpecError(
                f"OpAdapter({op}).{field_name}[{position}] is {type(transform).__name__}, which "
                f"applies to {transform.side}s; move it to {other}"
            )
    return FrozenDict(dict(sorted(mapping.items())))


@dataclass(frozen=True)
class OpAdapter:
    """An opaque op and the transforms for its argument and output positions.

    ``op`` is the op object (``torch.ops.mypkg.myop.default``) or its qualified name
    (``"mypkg::myop"``); a name is turned into the op only by :meth:`resolve`, so a
    spec can be built before the library that registers the op is imported.
    """

    op: Any = field(compare=False)
    arg_transforms: Mapping[int, Transform] = field(default_factory=FrozenDict)
    output_transforms: Mapping[int, Transform] = field(default_factory=FrozenDict)
    qualified_name: str = field(init=False)

    def __post_init__(self) -> None:
        name = _op_name(self.op)
        object.__setattr__(self, "qualified_name", name)
        for field_name, side in (("arg_transforms", "input"), ("output_transforms", "output")):
            checked = _check_transforms(getattr(self, field_name), side, field_name, name)
            object.__setattr__(self, field_name, checked)

    @property
    def target_name(self) -> str:
        return self.qualified_name

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE [picklable specs]: op objects do not pickle; the name does, and spawned
        # ranks resolve it after importing the op's library.
        return (
            type(self),
            (self.qualified_name, dict(self.arg_transforms), dict(self.output_transforms)),
        )

    def resolve(self) -> Any:
        """The ``torch._ops.OpOverload`` this adapter names."""
        import torch

        if isinstance(self.op, torch._ops.OpOverload):
            return self.op
        ns, _, rest = self.qualified_name.partition("::")
        name, _, overload = rest.partition(".")
        try:
            packet = getattr(getattr(torch.ops, ns), name)
            return getattr(packet, overload or "default")
        except (AttributeError, RuntimeError):
            raise SpecError(
                f"custom op {self.qualified_name} is not registered with torch; import the "
                "module that defines it (torch.library.custom_op / TORCH_LIBRARY) before the "
                "model runs, or fix the name in the spec"
            ) from None


# ---- patching adapters --------------------------------------------------------------------


def _callable_key(replacement: Callable[..., Any] | str) -> Any:
    """What identifies a replacement: its reference when it has a usable one."""
    if isinstance(replacement, str):
        return ":".join(split_ref(replacement))
    module = getattr(replacement, "__module__", None)
    qualname = getattr(replacement, "__qualname__", None)
    if module and qualname and "<" not in qualname:
        return f"{module}:{qualname}"
    return replacement


def _check_replacement(replacement: Any, owner: str) -> None:
    if isinstance(replacement, str):
        split_ref(replacement)
    elif not callable(replacement):
        raise SpecError(
            f"{owner}: replacement must be a callable or a 'module:function' reference, "
            f"not {replacement!r}"
        )


def _resolve_replacement(replacement: Any, label: str) -> Callable[..., Any]:
    if isinstance(replacement, str):  # a name: a function defined where it says
        return resolve_defined(replacement, kind="function", what=f"the replacement of {label}")
    return replacement


def _is_function(obj: Any) -> bool:
    """A Python or builtin function, or a TorchScript function (what Python/Jit adapters
    patch)."""
    if inspect.isroutine(obj):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.jit.ScriptFunction)


class _PatchingAdapter:
    """``install()`` / ``restore()`` shared by the patching adapters."""

    def _apply(self) -> PatchHandle:
        raise NotImplementedError

    def install(self) -> None:
        """Apply the patch until :meth:`restore`; prefer ``with installed([...])``."""
        _INSTALLED.setdefault(self, []).append(self._apply())

    def restore(self) -> None:
        """Undo the most recent :meth:`install` of this adapter."""
        stack = _INSTALLED.get(self)
        if not stack:
            raise SpecError(f"{self!r} is not installed; call install() before restore()")
        remove_patch(stack.pop())
        if not stack:
            del _INSTALLED[self]

    def is_installed(self) -> bool:
        return bool(_INSTALLED.get(self))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._key() == self._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[Any, ...]:
        raise NotImplementedError


_INSTALLED: dict[_PatchingAdapter, list[PatchHandle]] = {}


@dataclass(frozen=True, init=False, eq=False)
class MethodAdapter(_PatchingAdapter):
    """Swap ``Class.method_name`` for ``replacement`` while installed.

    Two equivalent forms::

        MethodAdapter(RealClass, "forward", my_forward)
        MethodAdapter(module_path="pkg.mod", class_name="RealClass",
                      method_name="forward", replacement="my_pkg.patches:my_forward")

    The keyword form imports nothing until installed. ``replacement`` (a callable or a
    ``"module:function"`` reference) is called as ``replacement(original, self, *args,
    **kwargs)``; ``original`` is the method it replaces, unbound, so it can delegate
    with ``original(self, *args, **kwargs)``.
    """

    kind: ClassVar[str] = "method"

    module_path: str
    class_name: str
    method_name: str
    replacement: Callable[..., Any] | str
    target: type | None = field(default=None, repr=False)

    def __init__(
        self,
        cls: type | None = None,
        method_name: str | None = None,
        replacement: Callable[..., Any] | str | None = None,
        *,
        module_path: str | None = None,
        class_name: str | None = None,
    ) -> None:
        if cls is not None:
            if not isinstance(cls, type):
                raise SpecError(
                    f"MethodAdapter's first argument must be the class to patch, not {cls!r}; "
                    "for the keyword form pass module_path=, class_name=, method_name=, replacement="
                )
            if module_path is not None or class_name is not None:
                raise SpecError(
                    "MethodAdapter got both a class and module_path/class_name; pass one form"
                )
            module_path, class_name = cls.__module__, cls.__qualname__
        missing = [
            n
            for n, v in (
                ("module_path", module_path),
                ("class_name", class_name),
                ("method_name", method_name),
                ("replacement", replacement),
            )
            if v is None
        ]
        if missing:
            raise SpecError(
                f"MethodAdapter is missing {', '.join(missing)}; write "
                "MethodAdapter(RealClass, 'method', replacement) or the keyword form"
            )
        for n, v in (("module_path", module_path), ("class_name", class_name)):
            if not all(p.isidentifier() for p in str(v).split(".")) and "<locals>" not in str(v):
                raise SpecError(f"MethodAdapter {n}={v!r} is not a dotted Python name")
        if not isinstance(method_name, str) or not method_name.isidentifier():
            raise SpecError(f"MethodAdapter method_name={method_name!r} is not a Python name")
        _check_replacement(replacement, f"MethodAdapter({class_name}.{method_name})")
        object.__setattr__(self, "module_path", module_path)
        object.__setattr__(self, "class_name", class_name)
        object.__setattr__(self, "method_name", method_name)
        object.__setattr__(self, "replacement", replacement)
        object.__setattr__(self, "target", cls)

    @property
    def target_name(self) -> str:
        return f"{self.module_path}:{self.class_name}.{self.method_name}"

    def _key(self) -> tuple[Any, ...]:
        return (
            self.module_path,
            self.class_name,
            self.method_name,
            _callable_key(self.replacement),
        )

    def resolve_class(self) -> type:
        """The class to patch (imports ``module_path`` in the keyword form)."""
        if self.target is not None:
            return self.target
        return resolve_defined(
            f"{self.module_path}:{self.class_name}",
            kind="class",
            what=f"the class of MethodAdapter({self.class_name}.{self.method_name})",
        )

    def _apply(self) -> PatchHandle:
        label = f"MethodAdapter({self.class_name}.{self.method_name})"
        cls = self.resolve_class()
        current = inspect.getattr_static(cls, self.method_name, None)
        if current is None:
            raise SpecError(
                f"{label}: {cls.__qualname__} has no method {self.method_name!r}; the installed "
                f"{self.module_path} may be a version the adapter was not written for"
            )
        if isinstance(current, (staticmethod, classmethod, property)):
            raise SpecError(
                f"{label}: {self.method_name} is a {type(current).__name__}; MethodAdapter "
                "replaces instance methods only (use PythonAdapter for plain functions)"
            )
        if not inspect.isfunction(current):
            raise SpecError(
                f"{label}: {cls.__qualname__}.{self.method_name} is {current!r}, not a method "
                "defined in Python; MethodAdapter replaces instance methods written in Python"
            )
        replacement = _resolve_replacement(self.replacement, label)

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
                return replacement(original, self, *args, **kwargs)

            return patched

        return apply_patch(cls, self.method_name, wrap, label)


@dataclass(frozen=True, eq=False)
class PythonAdapter(_PatchingAdapter):
    """Swap the module-level function ``module_path.function_name`` while installed.

    ``replacement`` (a callable or ``"module:function"`` reference) is called with the
    helper's own arguments; with ``pass_original=True`` it is called as
    ``replacement(original, *args, **kwargs)`` so it can delegate.

    NOTE [module attribute swaps]: only look-ups through the module see the swap
    (``mod.helper(...)``, or a bare ``helper(...)`` inside ``mod`` itself); a name
    copied out earlier with ``from mod import helper`` keeps the original. Patch the
    module where the caller looks the name up.
    """

    kind: ClassVar[str] = "python"

    module_path: str
    function_name: str
    replacement: Callable[..., Any] | str
    pass_original: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.module_path, str) or not all(
            p.isidentifier() for p in self.module_path.split(".")
        ):
            raise SpecError(f"{name} module_path={self.module_path!r} is not a dotted module path")
        if not isinstance(self.function_name, str) or not self.function_name.isidentifier():
            raise SpecError(f"{name} function_name={self.function_name!r} is not a Python name")
        _check_replacement(self.replacement, f"{name}({self.target_name})")

    @property
    def target_name(self) -> str:
        return f"{self.module_path}:{self.function_name}"

    def _key(self) -> tuple[Any, ...]:
        return (
            self.module_path,
            self.function_name,
            _callable_key(self.replacement),
            self.pass_original,
        )

    def _apply(self) -> PatchHandle:
        label = f"{type(self).__name__}({self.target_name})"
        module = import_module(self.module_path, what=label)
        if self.function_name not in vars(module):
            raise SpecError(
                f"{label}: module {self.module_path} has no function {self.function_name!r}; "
                "the installed version may differ from the one the adapter was written for"
            )
        current = vars(module)[self.function_name]
        if not _is_function(current):
            raise SpecError(
                f"{label}: {self.module_path}.{self.function_name} is {current!r}, not a "
                f"function; {type(self).__name__} replaces module-level functions only"
            )
        replacement = _resolve_replacement(self.replacement, label)

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            if not self.pass_original:
                return replacement

            @functools.wraps(original)
            def delegating(*args: Any, **kwargs: Any) -> Any:
                return replacement(original, *args, **kwargs)

            return delegating

        return apply_patch(module, self.function_name, wrap, label)


@dataclass(frozen=True, eq=False)
class JitAdapter(PythonAdapter):
    """Swap a ``torch.jit.script``-ed module-level function while installed.

    Same fields and guarantees as :class:`PythonAdapter`. The replacement runs as plain
    Python: eager callers that look the name up through the module see it, but
    TorchScript code compiled before the swap has the old function baked in, so patch
    the scripted helper itself rather than a scripted caller.
    """

    kind: ClassVar[str] = "jit"
