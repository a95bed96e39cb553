"""A lightweight record of the torch ops a model runs, single-process.

`OpTrace` is a ``TorchFunctionMode``: every torch function, tensor method and
``torch.ops`` call made while it is active is counted by name. What matters to
validation is the opaque ops: calls into ``torch.ops.<namespace>`` other than aten/prim
(custom ops wrapping Warp, Triton or C++ kernels). The ShardTensor dispatch cannot see
inside them, so a per-atom accumulation done there misses the other ranks'
contributions unless the spec declares an ``OpAdapter``.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# Namespaces of torch's own decomposed ops: the dispatch understands these.
_TORCH_NAMESPACES = frozenset({"aten", "prim", "prims"})


def op_name(func) -> str:
    """``ns::op.overload`` for ``torch.ops`` calls, the plain ``__name__`` otherwise."""
    if isinstance(func, torch._ops.OpOverload):
        return func.name() if "." in func.name() else f"{func.name()}.default"
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name
    return getattr(func, "__name__", repr(func))


def op_namespace(func) -> str | None:
    """The ``torch.ops`` namespace of ``func``, or None for ordinary torch functions."""
    if isinstance(func, torch._ops.OpOverload):
        return func.namespace
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name.partition("::")[0]
    return None


def is_opaque(func) -> bool:
    namespace = op_namespace(func)
    return namespace is not None and namespace not in _TORCH_NAMESPACES


class OpTrace(TorchFunctionMode):
    """``with OpTrace() as trace: model(batch)``; then ``trace.counts`` / ``trace.opaque_ops``."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.opaque: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        self.counts[name] += 1
        if is_opaque(func):
            # a call through the packet resolves to its default overload; count that name
            self.opaque[name if "." in name.partition("::")[2] else f"{name}.default"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def opaque_ops(self) -> list[str]:
        """Opaque custom ops called, as ``ns::op.overload``, most frequent first."""
        return [name for name, _ in self.opaque.most_common()]


def op_attribute_path(qualified: str) -> str:
    """``"ns::op.overload"`` -> ``"torch.ops.ns.op.overload"`` (what a spec author writes)."""
    namespace, _, rest = qualified.partition("::")
    name, _, overload = rest.partition(".")
    return f"torch.ops.{namespace}.{name}.{overload or 'default'}"
