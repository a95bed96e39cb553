"""Dispatch rules for sharded storage: a rank keeps only the rows of the atoms it owns.

Under halo storage a rank also stores a mirror of every remote atom it may read; under
sharded storage it stores none. A per-atom index (a neighbour list's senders) then
addresses ``[owned rows | request table]``: ``i < n_owned`` is an owned row and
``n_owned + k`` the ``k``-th remote atom this rank reads. The request table is an
`ExchangePlan` (``meta.plan``) built once per neighbour-list rebuild: one row per
remote atom, grouped by owner, so the owners know which of their rows to send.

The rules (registered for the `Sharded` layout; their order is stated in
`mlipdd.shard.registry.PRECEDENCE`):

* a gather of node rows by an integer index (``x[idx]``, ``index_select``) routes:
  owners send the requested rows over ``all_to_all_single``, the reader indexes
  ``[owned | received]`` once and drops it; backward sends each gradient back to the
  owner of its row, which adds it up (`mlipdd.shard.exchange.pad`);
* a scatter into node rows adds the owned part locally and sends the request-table
  part to the owners (the adjoint of the gather);
* a scatter into one row per system is a local sum plus an ``all_reduce``; the result
  is *replicated* (see the NOTE below); a whole-tensor sum over atoms or edges is the
  same sum, returned plain as under halo storage;
* a replicated value read per atom or per edge (``lam[batch.batch]``, ``chi - lam``)
  enters the per-rank rows through an identity whose backward is an ``all_reduce``
  (the row boundary of every layout, `mlipdd.shard.replicated`).

# NOTE [replicated gradients]
A replicated tensor ``S`` (say the Lagrange multiplier of charge equilibration, one
per system) is identical on every rank. Its consumers are of two kinds: replicated
ones (the energy and its backward seed) hand it the full gradient on every rank,
while per-rank ones (an owned atom's charge ``(lam - chi) / J``) hand it only that
rank's share. The ``all_reduce`` that makes ``S`` has an identity adjoint, which is
right for the first kind only; so the second kind passes through `_ReplicatedToRows`
on its way into the rows, whose backward sums the shares over ranks. That is why
reductions here return ShardTensors marked replicated instead of plain tensors: the
dispatch can then see where a replicated value meets per-rank rows.

# NOTE [collective order]
Every routed gather and distributed scatter is a collective, whatever its index
holds: a rank whose index happens to point only at owned rows still takes part.
"""

from __future__ import annotations

import torch

from mlipdd.shard.exchange import all_reduce_sum, halo_accumulate, pad
from mlipdd.shard.handlers import (
    SCATTER_OPS,
    _finish,
    _parse,
    _sum_dims,
    _target_rows,
    by_system_index,
    read_placement,
    refuse_opaque_source,
)
from mlipdd.shard.layouts import Sharded
from mlipdd.shard.placement import ATOMS, rows_kind
from mlipdd.shard.registry import register
from mlipdd.shard.replicated import replicated, to_rows
from mlipdd.shard.tensor import ShardMeta, ShardTensor, local

__all__ = ["routed_gather", "to_rows"]


def _sharded_rows(meta) -> bool:
    return meta is not None and meta.layout.is_sharded()


def _meta_of(t) -> ShardMeta | None:
    return t._meta if isinstance(t, ShardTensor) else None


# ---- gathers ------------------------------------------------------------------------
def routed_gather(rows: torch.Tensor, plan, func=torch.Tensor.__getitem__, *rest, **kwargs) -> torch.Tensor:
    """``func(table, *rest)`` on ``table = [owned rows | request table]`` (plain tensors).

    The table exists only inside this call; autograd keeps the index, not the table.
    """
    table = pad(rows, plan)
    with torch._C.DisableTorchFunctionSubclass():
        return func(table, *rest, **kwargs)


def _is_int_rows(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dim() >= 1 and not index.is_floating_point() \
        and index.dtype != torch.bool


def _gather_index(func, args, kwargs):
    """The integer index of a row gather (or None when the call is something else)."""
    if func in (torch.Tensor.index_select, torch.index_select):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        index = args[2] if len(args) > 2 else kwargs.get("index")
        return index if dim in (0, -local(args[0]).dim()) and _is_int_rows(index) else None
    key = args[1] if len(args) > 1 else None
    if isinstance(key, tuple) and key and all(not isinstance(k, torch.Tensor) for k in key[1:]):
        key = key[0]
    return key if _is_int_rows(key) else None


def _is_row_gather(func, meta, args, kwargs) -> bool:
    """``func`` reads node rows of a sharded tensor by an integer index."""
    x = args[0] if args else None
    return (
        _sharded_rows(_meta_of(x))
        and x._meta.layout.route_gathers
        and x.dim() > 0
        and rows_kind(x, x._meta) == "node"
        and _gather_index(func, args, kwargs) is not None
    )


@register(Sharded, torch.Tensor.index_select, torch.index_select, torch.Tensor.__getitem__,
          predicate=_is_row_gather, name="sharded_gather")
def _gather(func, meta, args, kwargs):
    """Owned rows + rows fetched from their owners, indexed like one process would."""
    x, index = args[0], _gather_index(func, args, kwargs)
    rest = [local(a) for a in args[1:]]
    if rest and isinstance(rest[0], tuple):  # x[idx, ...]
        rest[0] = tuple(local(k) for k in rest[0])
    kwargs = {k: local(v) for k, v in kwargs.items()}
    place = read_placement(x, index, x._meta, padded_table=ATOMS)  # every row read from its owner
    return ShardTensor.wrap(routed_gather(local(x), x._meta.plan, func, *rest, **kwargs), x._meta, place)


# ---- reductions to replicated values -------------------------------------------------
# NOTE [ambiguous rows]: the node rule goes ahead of the system rule (as for halo
# storage, see PRECEDENCE). Where a rank owns as many atoms as there are systems the
# two are told apart by the index's placement: a scatter by a system index
# (``batch.batch``, ``values="systems"``) is per system, whatever the row counts.
def _is_system_scatter(func, meta, args, kwargs) -> bool:
    if not _sharded_rows(meta) or not meta.system_reductions:
        return False
    dim, rows = _target_rows(args, kwargs)
    return dim == 0 and (by_system_index(args, kwargs) or (rows == meta.n_systems and rows != meta.n_owned))


@register(Sharded, *SCATTER_OPS, predicate=_is_system_scatter, name="sharded_per_system_reduce")
def sharded_per_system_reduce(func, meta: ShardMeta, args, kwargs):
    """Scatter into one row per system: local partial (every row is owned), then all_reduce."""
    call = _parse(func, args, kwargs)
    base = local(call.target)
    src_meta = _meta_of(call.src)
    rows_meta = src_meta if _sharded_rows(src_meta) else meta
    if rows_kind(call.src, rows_meta) == "other":
        raise RuntimeError(
            f"{call.name} into per-system rows: cannot tell whether the {call.src.shape[0]} source "
            f"rows are atoms ({rows_meta.n_owned} owned here) or edges ({rows_meta.n_edges} here); "
            "reduce a per-atom or per-edge tensor, or declare the op in the model's spec"
        )
    partial = call.scatter_into(torch.zeros_like(base), local(call.index), local(call.src))
    total = base + all_reduce_sum(partial, meta.group)
    return _finish(call, ShardTensor.wrap(total, meta.as_replicated()))


# ---- scatters into node rows ------------------------------------------------------------
def _is_node_scatter(func, meta, args, kwargs) -> bool:
    if not _sharded_rows(meta) or not meta.layout.route_scatters:
        return False
    dim, rows = _target_rows(args, kwargs)
    return dim == 0 and rows == meta.n_owned and not by_system_index(args, kwargs)


@register(Sharded, *SCATTER_OPS, predicate=_is_node_scatter, name="sharded_scatter")
def sharded_scatter(func, meta: ShardMeta, args, kwargs):
    """Scatter into owned rows; contributions to request-table rows go to their owners."""
    call = _parse(func, args, kwargs)
    refuse_opaque_source(call, meta)
    base = local(call.target)
    table = base.new_zeros((meta.plan.n_padded, *base.shape[1:]))
    contribution = call.scatter_into(table, local(call.index), local(call.src))
    out = base + halo_accumulate(contribution, meta.plan)[: meta.n_owned]
    return _finish(call, ShardTensor.wrap(out, meta, ATOMS))


def _is_row_sum(func, meta, args, kwargs) -> bool:
    x = args[0] if args else kwargs.get("input")
    if not _sharded_rows(_meta_of(x)) or x.dim() == 0 or not meta.system_reductions:
        return False
    dims = _sum_dims(args, kwargs)
    return (dims is None or 0 in dims) and rows_kind(x, meta) != "other"


@register(Sharded, torch.Tensor.sum, torch.sum, predicate=_is_row_sum, name="sharded_global_sum")
def sharded_global_sum(func, meta: ShardMeta, args, kwargs):
    """A sum over atoms or edges: local partial, then all_reduce; replicated, as under halo
    storage (NOTE [whole sums are replicated] in `mlipdd.shard.handlers`)."""
    x = local(args[0])
    rest = {k: v for k, v in kwargs.items() if k != "input"}
    with torch._C.DisableTorchFunctionSubclass():
        partial = torch.sum(x, *args[1:], **rest)
    return replicated(all_reduce_sum(partial, meta.group), meta)
