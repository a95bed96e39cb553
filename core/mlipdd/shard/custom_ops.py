"""OpAdapter execution: opaque custom ops (Warp, Triton, fused kernels) under domain decomposition.

A ``torch.library.custom_op`` called with a ShardTensor argument reaches
`ShardTensor.__torch_function__` as its ``OpOverload`` (``torch.ops.ns.op.default``,
also when the decorated Python function is called) or as its ``OpOverloadPacket``
(``torch.ops.ns.op``). Inside, the kernel reads raw buffers, so no dispatch rule can
see what it does with rows. An ``OpAdapter`` in the spec's ``custom_ops`` says it
instead, per argument and output position; this module interprets that around the call:

    ShardTensor args --input transforms--> plain tensors --op--> plain outputs
        --output transforms--> ShardTensors (per-atom rows) / replicated tensors

Inputs (halo layout ``[owned | ghost]``; ``n_owned`` / ``n_padded`` rows):

* ``GatherInputs``: owned rows -> padded rows (ghost rows from their owners, `pad`);
  an argument that is already padded passes as is.
* ``SliceOwned``: padded rows -> owned rows.
* ``GatherInputsFull``: owned rows of every rank -> all ``n_global`` rows in global
  atom-id order (the op sees the whole system).

Outputs:

* ``ScatterOutputs``: per-atom partials, ghost rows included -> ghost partials added
  into their owners, ghost rows refreshed (`halo_correct`).
* ``AllReduceSum``: a per-rank partial sum -> the total on every rank, marked
  replicated: used as is (an energy term) its backward is the identity (NOTE
  [replicated backward] in ``exchange``); read per atom, the gradient shares of the
  ranks are summed (NOTE [replicated gradients] in ``replicated``).
* ``SliceOutputsOwned``: ``n_global`` rows (after ``GatherInputsFull``) -> this rank's
  rows in its own layout, ``[owned | ghost]``, so the rest of the model continues on
  the padded rows it already works with.

Adapters are active only inside `activated` (DistributedModel wraps the model's
forward in it); elsewhere a custom op runs as plain torch. Every transform is made of
autograd functions, so gradients flow through the op (its ``register_autograd``
formula) and the exchanges alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from mlipdd.comm import group_size
from mlipdd.shard import registry
from mlipdd.shard.exchange import all_reduce_sum, all_to_all_rows, halo_correct, pad
from mlipdd.shard.layouts import Layout
from mlipdd.shard.replicated import is_replicated, replicated, to_rows
from mlipdd.shard.tensor import ShardMeta, ShardTensor, local
from mlipdd.spec.transforms import (
    AllReduceSum,
    GatherInputs,
    GatherInputsFull,
    ScatterOutputs,
    SliceOutputsOwned,
    SliceOwned,
)

__all__ = ["activated", "active_row_ids", "adapter_for", "call_adapted"]

_OP_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


@dataclass
class _Active:
    """The adapters of one forward pass and what the global-row transforms need."""

    by_op: dict[Any, Any]  # OpOverload / OpOverloadPacket -> OpAdapter
    row_ids: torch.Tensor | None  # global atom id of each [owned | ghost] row
    _global: tuple | None = field(default=None, repr=False)  # see `global_rows`

    def global_rows(self, meta: ShardMeta) -> tuple[tuple[int, ...], torch.Tensor]:
        """``(owned rows per rank, gather position of each global id)``; collective, once
        per forward (every rank reaches it: the model code is the same everywhere)."""
        if self._global is None:
            if self.row_ids is None:
                raise RuntimeError(
                    "GatherInputsFull / SliceOutputsOwned need the global atom ids of this rank's "
                    "rows; activate the adapters with activated(spec, row_ids=padded_batch.atom_ids) "
                    "(DistributedModel does this)"
                )
            owned_ids = self.row_ids[: meta.n_owned]
            counts = _gather_counts(meta.n_owned, owned_ids.device, meta.group)
            all_ids = _all_gather_rows(owned_ids, counts, meta.group)
            n_global = all_ids.shape[0]
            if not torch.equal(all_ids.sort().values, torch.arange(n_global, device=all_ids.device)):
                raise RuntimeError(
                    "GatherInputsFull: the ranks' atom ids are not 0..N-1 exactly once; the batch "
                    "must carry the ids Batch.from_data_list assigns (do not renumber atom_ids)"
                )
            position = torch.empty_like(all_ids).index_copy_(0, all_ids, torch.arange(n_global, device=all_ids.device))
            self._global = (counts, position)
        return self._global


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


def _unwrap(value: Any, layout: ShardMeta) -> Any:
    """Plain tensors for the op. A replicated value (a per-system sum) used next to this
    rank's rows gets its gradient summed over ranks (NOTE [replicated gradients])."""
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, layout) for v in value)
    if is_replicated(value):
        return to_rows(local(value), layout.group)
    return local(value)


def _row_layout(meta: ShardMeta, args: list, kwargs: dict) -> ShardMeta:
    """The ``[owned | ghost]`` layout of the call (the first ShardTensor may be replicated)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, ShardTensor) and not is_replicated(value):
            return value._meta
    return meta.as_rows()


def _has_adapter(func: Any, meta: ShardMeta, args: tuple, kwargs: dict) -> bool:
    return adapter_for(func) is not None


@registry.register(Layout, registry.ANY_OP, name="op_adapter", predicate=_has_adapter)
def adapted_op(func: Any, meta: ShardMeta, args: tuple, kwargs: dict) -> Any:
    """An opaque custom op with an OpAdapter in the spec: its transforms around the call."""
    return call_adapted(adapter_for(func), func, meta, args, kwargs)


def _owned_rows_only(adapter: Any) -> bool:
    """Whether the adapter's transforms mean the same on sharded storage's owned rows: an
    op that reads only its own rows (``SliceOwned`` is then the identity) and returns
    partial sums (``AllReduceSum``); PME's spread and gather are such ops."""
    transforms = (*adapter.arg_transforms.values(), *adapter.output_transforms.values())
    return all(isinstance(t, (SliceOwned, AllReduceSum)) for t in transforms)


def _check_positions(transforms, n: int, what: str, but: str) -> None:
    for position in transforms:
        if position >= n:
            raise RuntimeError(f"{what} has position {position}, but {but.format(n)}")


def call_adapted(adapter: Any, func: Any, meta: ShardMeta, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on plain tensors with ``adapter``'s transforms around it."""
    registry.FIRED[f"op_adapter:{adapter.qualified_name}"] += 1
    active = _ACTIVE.get()
    args, kwargs = _positional(func, args, kwargs)
    meta = _row_layout(meta, args, kwargs)
    where = f"OpAdapter({adapter.qualified_name})"
    if not meta.layout.is_halo() and not (meta.layout.is_sharded() and _owned_rows_only(adapter)):
        raise NotImplementedError(
            f"{where}: OpAdapter transforms other than SliceOwned and AllReduceSum are implemented "
            f"for halo storage only, and this model runs with {type(meta.layout).__name__} storage; "
            "run it with the halo strategy (HaloStoragePolicy)"
        )
    _check_positions(adapter.arg_transforms, len(args), f"{where}.arg_transforms",
                     "the op was called with {} positional argument(s); key transforms by the op's argument position")
    plain = [
        _transform_input(adapter.arg_transforms.get(i), value, meta, active, f"{where} argument {i}")
        for i, value in enumerate(args)
    ]
    out = func(*plain, **{k: _unwrap(v, meta) for k, v in kwargs.items()})
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    _check_positions(adapter.output_transforms, len(outputs), f"{where}.output_transforms",
                     "the op returned {} output(s)")
    done = [
        _transform_output(adapter.output_transforms.get(i), value, meta, active, f"{where} output {i}")
        for i, value in enumerate(outputs)
    ]
    return type(out)(done) if isinstance(out, (tuple, list)) else done[0]


# ---- input transforms -----------------------------------------------------------------


def _rows(value: Any, what: str, transform: Any) -> int:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        raise RuntimeError(
            f"{what} has {type(transform).__name__}(), which needs a tensor with one row per atom, "
            f"got {type(value).__name__}; move the transform to the op's per-atom argument"
        )
    return value.shape[0]


def _row_error(what: str, transform: Any, rows: int, meta: ShardMeta, expected: str) -> RuntimeError:
    return RuntimeError(
        f"{what} has {type(transform).__name__}() but {rows} rows, while this rank has "
        f"{meta.n_owned} owned and {meta.n_padded} owned+ghost rows; {expected}"
    )


def _owned_rows(value: torch.Tensor, meta: ShardMeta, what: str, transform: Any) -> torch.Tensor:
    rows = _rows(value, what, transform)
    if rows == meta.n_padded:
        return local(value)[: meta.n_owned]
    if rows == meta.n_owned:
        return local(value)
    raise _row_error(what, transform, rows, meta, "it takes a per-atom tensor (owned or owned+ghost rows)")


def _transform_input(transform: Any, value: Any, meta: ShardMeta, active: _Active, what: str) -> Any:
    if transform is None:
        return _unwrap(value, meta)
    if isinstance(transform, SliceOwned):
        return _owned_rows(value, meta, what, transform)
    if isinstance(transform, GatherInputs):
        rows = _rows(value, what, transform)
        if rows == meta.n_padded:
            return local(value)  # ghost rows already mirror their owners
        if rows == meta.n_owned:
            # no image shift: gather per-atom features, not positions (those arrive padded)
            return pad(local(value), meta.plan)
        raise _row_error(what, transform, rows, meta, "GatherInputs pads owned rows to owned+ghost rows")
    if isinstance(transform, GatherInputsFull):
        owned = _owned_rows(value, meta, what, transform)
        counts, position = active.global_rows(meta)
        gathered = _AllGatherRows.apply(owned, counts, meta.group)
        return gathered.index_select(0, position)  # source-rank order -> global id order
    raise NotImplementedError(f"{what}: {type(transform).__name__} is not an input transform")


# ---- output transforms ----------------------------------------------------------------


def _transform_output(transform: Any, value: Any, meta: ShardMeta, active: _Active, what: str) -> Any:
    if transform is None:
        return ShardTensor.wrap(value, meta) if isinstance(value, torch.Tensor) else value
    if isinstance(transform, ScatterOutputs):
        rows = _rows(value, what, transform)
        if rows != meta.n_padded:
            raise _row_error(what, transform, rows, meta,
                             "ScatterOutputs corrects an output with one row per owned+ghost atom")
        return ShardTensor.wrap(halo_correct(local(value), meta.plan), meta)
    if isinstance(transform, AllReduceSum):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what} has AllReduceSum() but is {type(value).__name__}, not a tensor")
        # replicated: a later per-atom use sums its gradient over ranks (see `replicated`)
        return replicated(all_reduce_sum(local(value), meta.group), meta)
    if isinstance(transform, SliceOutputsOwned):
        rows = _rows(value, what, transform)
        counts, _ = active.global_rows(meta)
        if rows != sum(counts):
            raise RuntimeError(
                f"{what} has SliceOutputsOwned() but {rows} rows; it takes an output with one row "
                f"per atom of the whole batch ({sum(counts)}), e.g. from a GatherInputsFull argument"
            )
        return ShardTensor.wrap(local(value).index_select(0, active.row_ids), meta)
    raise NotImplementedError(f"{what}: {type(transform).__name__} is not an output transform")


# ---- the all-gather of owned rows -----------------------------------------------------


def _gather_counts(n_owned: int, device: torch.device, group: Any) -> tuple[int, ...]:
    world = group_size(group)
    mine = torch.full((world, 1), n_owned, dtype=torch.int64, device=device)
    return tuple(int(c) for c in all_to_all_rows(mine, [1] * world, [1] * world, group).flatten())


def _all_gather_rows(owned: torch.Tensor, counts: tuple[int, ...], group: Any) -> torch.Tensor:
    """Every rank's owned rows, grouped by source rank (uneven counts allowed)."""
    world = len(counts)
    copies = owned.repeat(world, *([1] * (owned.dim() - 1)))  # one copy per destination
    return all_to_all_rows(copies, [owned.shape[0]] * world, counts, group)


class _AllGatherRows(torch.autograd.Function):
    """owned rows -> every rank's owned rows; the adjoint sums each rank's gradient of
    this rank's rows (every rank used them) back onto the owner."""

    @staticmethod
    def forward(ctx, owned, counts, group):
        ctx.counts, ctx.group, ctx.n_owned = counts, group, owned.shape[0]
        return _all_gather_rows(owned, counts, group)

    @staticmethod
    def backward(ctx, grad):
        world = len(ctx.counts)
        back = all_to_all_rows(grad.contiguous(), ctx.counts, [ctx.n_owned] * world, ctx.group)
        return back.view(world, ctx.n_owned, *grad.shape[1:]).sum(0), None, None
