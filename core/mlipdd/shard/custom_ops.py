"""OpAdapters: which adapters are active in a forward, and the full-row gathers they use.

A ``torch.library.custom_op`` (Warp, Triton, fused kernels) reads raw buffers, so no
dispatch rule can see what it does with rows. An ``OpAdapter`` in the spec's
``custom_ops`` says it instead, per argument and output position; the aten dispatch
interprets it around the call (`mlipdd.shard.aten.adapters`, NOTE [aten op adapters]).
Adapters are active only inside `activated` (DistributedModel wraps the model's forward in
it); elsewhere a custom op runs as plain torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from mlipdd.comm import group_size
from mlipdd.shard.exchange import all_to_all_rows

__all__ = ["activated", "active_row_ids", "adapter_for"]

_OP_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


@dataclass
class _Active:
    """The adapters of one forward pass and the global atom id of each row."""

    by_op: dict[Any, Any]  # OpOverload / OpOverloadPacket -> OpAdapter
    row_ids: torch.Tensor | None  # global atom id of each [owned | ghost] row


_ACTIVE: ContextVar[_Active | None] = ContextVar("mlipdd_active_custom_ops", default=None)


def _adapters_of(spec: Any) -> tuple:
    distribution = getattr(spec, "distribution", spec)  # an MLIPSpec or a DistributionSpec
    ops = getattr(distribution, "custom_ops", None)
    return tuple(ops if ops is not None else spec)


@contextmanager
def activated(spec: Any, row_ids: torch.Tensor | None = None) -> Iterator[None]:
    """Apply the OpAdapters of ``spec`` (an MLIPSpec, DistributionSpec or iterable of
    OpAdapter) to custom ops called with ShardTensors inside the block.

    ``row_ids``: global atom id of each ``[owned | ghost]`` row (``padded.atom_ids``),
    needed only by ``GatherInputsFull`` / ``SliceOutputsOwned``.
    """
    adapters = _adapters_of(spec)
    if not adapters:
        yield
        return
    by_op: dict[Any, Any] = {}
    for adapter in adapters:
        overload = adapter.resolve()  # a clear SpecError when the op's library is not imported
        by_op[overload] = adapter
        packet = overload.overloadpacket
        # NOTE [packet calls]: torch.ops.ns.op(...) reaches the dispatch as the packet;
        # it means the default overload (the only one a torch.library.custom_op has).
        if overload._overloadname == "default" or packet.overloads() == [overload._overloadname]:
            by_op[packet] = adapter
    token = _ACTIVE.set(_Active(by_op, row_ids))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def adapter_for(func: Any) -> Any:
    """The active OpAdapter for ``func``, or None (not a torch op, or none declared)."""
    active = _ACTIVE.get()
    if active is None or not isinstance(func, _OP_TYPES):
        return None
    return active.by_op.get(func)


def active_row_ids() -> torch.Tensor | None:
    """The global atom id of each row of the forward whose adapters are active, or None."""
    active = _ACTIVE.get()
    return None if active is None else active.row_ids


# ---- the call -------------------------------------------------------------------------


def _positional(func: Any, args: tuple, kwargs: dict) -> tuple[list, dict]:
    """Arguments by schema position (OpAdapter keys are positions), keyword-only rest."""
    overload = getattr(func, "default", None) if isinstance(func, torch._ops.OpOverloadPacket) else func
    schema = getattr(overload, "_schema", None)
    args, kwargs = list(args), dict(kwargs)
    if schema is None:
        return args, kwargs
    for argument in schema.arguments[len(args):]:
        if argument.kwarg_only or argument.name not in kwargs:
            break
        args.append(kwargs.pop(argument.name))
    return args, kwargs


def _gather_counts(n_owned: int, device: torch.device, group: Any) -> tuple[int, ...]:
    world = group_size(group)
    mine = torch.full((world, 1), n_owned, dtype=torch.int64, device=device)
    return tuple(int(c) for c in all_to_all_rows(mine, [1] * world, [1] * world, group).flatten())


def _all_gather_rows(owned: torch.Tensor, counts: tuple[int, ...], group: Any) -> torch.Tensor:
    """Every rank's owned rows, grouped by source rank (uneven counts allowed)."""
    world = len(counts)
    copies = owned.repeat(world, *([1] * (owned.dim() - 1)))  # one copy per destination
    return all_to_all_rows(copies, [owned.shape[0]] * world, counts, group)


