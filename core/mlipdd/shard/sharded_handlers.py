"""Dispatch rules for sharded storage: a rank keeps only the rows of the atoms it owns.

Under halo storage a rank also stores a mirror of every remote atom it may read; under
sharded storage it stores none. A per-atom index (a neighbour list's senders) then
addresses ``[owned rows | request table]``: ``i < n_owned`` is an owned row and
``n_owned + k`` the ``k``-th remote atom this rank reads. The request table is an
`ExchangePlan` (``meta.plan``) built once per neighbour-list rebuild: one row per
remote atom, grouped by owner, so the owners know which of their rows to send.

The rules (they accept only `ShardedMeta`, and go ahead of the halo rules):

* a gather of node rows by an integer index (``x[idx]``, ``index_select``) routes:
  owners send the requested rows over ``all_to_all_single``, the reader indexes
  ``[owned | received]`` once and drops it; backward sends each gradient back to the
  owner of its row, which adds it up (`mlipdd.shard.exchange.pad`);
* a scatter into node rows adds the owned part locally and sends the request-table
  part to the owners (the adjoint of the gather);
* a scatter into one row per system, or a sum over atoms or edges, is a local sum plus
  an ``all_reduce``; the result is *replicated* (see the NOTE below);
* a replicated value read per atom or per edge (``lam[batch.batch]``, ``chi - lam``)
  enters the per-rank rows through an identity whose backward is an ``all_reduce``.

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

import dataclasses
from dataclasses import dataclass, field

import torch

from mlipdd.shard.exchange import all_reduce_sum, halo_accumulate, pad
from mlipdd.shard.handlers import SCATTER_OPS, _finish, _parse, _sum_dims, _target_rows
from mlipdd.shard.registry import register
from mlipdd.shard.replicated import is_replicated, to_rows
from mlipdd.shard.tensor import ShardMeta, ShardTensor, local

__all__ = ["ShardedMeta", "routed_gather", "to_rows"]


@dataclass(frozen=True)
class ShardedMeta(ShardMeta):
    """Rows of a sharded tensor. ``plan`` is the request table (its ghosts = remote reads).

    ``global_ids`` are the atom ids of the owned rows and ``remote_ids`` those of the
    request-table rows. ``replicated`` marks a per-system result that every rank holds
    whole (energy, a Lagrange multiplier), whose rows are not atoms.
    """

    global_ids: torch.Tensor | None = field(default=None, compare=False)
    remote_ids: torch.Tensor | None = field(default=None, compare=False)
    replicated: bool = False

    @property
    def n_padded(self) -> int:
        # node tensors hold owned rows only; a replicated tensor has no node rows at all
        return -1 if self.replicated else self.plan.n_owned

    @property
    def n_remote(self) -> int:
        return self.plan.n_ghost

    def row_kind(self, rows: int) -> str:
        return "other" if self.replicated else super().row_kind(rows)

    def as_replicated(self) -> ShardedMeta:
        # system_reductions off: a replicated value is never summed over ranks again
        return dataclasses.replace(self, replicated=True, system_reductions=False)

    def as_rows(self) -> ShardedMeta:
        if not self.replicated:
            return self
        return dataclasses.replace(self, replicated=False, system_reductions=True)


def _rows_meta(meta) -> bool:
    return isinstance(meta, ShardedMeta) and not meta.replicated


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


def _row_gather_predicate(func):
    """Accepts ``func`` reading node rows of a sharded tensor by an integer index."""

    def predicate(meta, args, kwargs) -> bool:
        x = args[0] if args else None
        return (
            _rows_meta(_meta_of(x))
            and x._meta.gather_rule == "distributed"
            and x.dim() > 0
            and x.shape[0] == x._meta.n_owned
            and _gather_index(func, args, kwargs) is not None
        )

    return predicate


_GATHERS = (torch.Tensor.index_select, torch.index_select, torch.Tensor.__getitem__)


def _gather(func, meta, args, kwargs):
    """Owned rows + rows fetched from their owners, indexed like one process would."""
    x = args[0]
    rest = [local(a) for a in args[1:]]
    if rest and isinstance(rest[0], tuple):  # x[idx, ...]
        rest[0] = tuple(local(k) for k in rest[0])
    kwargs = {k: local(v) for k, v in kwargs.items()}
    return ShardTensor.wrap(routed_gather(local(x), x._meta.plan, func, *rest, **kwargs), x._meta)


for _op in _GATHERS:
    register(_op, predicate=_row_gather_predicate(_op), name="sharded_gather", first=True)(_gather)


# ---- reductions to replicated values -------------------------------------------------
# NOTE [ambiguous rows]: the system rule is registered before the node rule so that,
# both being put first, the node rule is tried first (as for halo storage); the
# strategy refuses layouts where a rank owns exactly as many atoms as there are
# systems, because the two scatters could then not be told apart by shape.
def _is_system_scatter(meta, args, kwargs) -> bool:
    if not isinstance(meta, ShardedMeta):
        return False
    dim, rows = _target_rows(args, kwargs)
    return dim == 0 and rows == meta.n_systems and (meta.replicated or meta.system_reductions)


@register(*SCATTER_OPS, predicate=_is_system_scatter, name="sharded_per_system_reduce", first=True)
def sharded_per_system_reduce(func, meta: ShardedMeta, args, kwargs):
    """Scatter into one row per system: local partial (every row is owned), then all_reduce."""
    call = _parse(func, args, kwargs)
    base = local(call.target)
    src_meta = _meta_of(call.src)
    if is_replicated(call.src):
        # replicated in, replicated out: every rank already holds the whole value
        out = call.scatter_into(base, local(call.index), local(call.src))
        return _finish(call, ShardTensor.wrap(out, src_meta))
    rows_meta = src_meta if _rows_meta(src_meta) else meta.as_rows()
    if rows_meta.row_kind(call.src.shape[0]) == "other":
        raise RuntimeError(
            f"{call.name} into per-system rows: cannot tell whether the {call.src.shape[0]} source "
            f"rows are atoms ({rows_meta.n_owned} owned here) or edges ({rows_meta.n_edges} here); "
            "reduce a per-atom or per-edge tensor, or declare the op in the model's spec"
        )
    partial = call.scatter_into(torch.zeros_like(base), local(call.index), local(call.src))
    total = base + all_reduce_sum(partial, meta.group)
    return _finish(call, ShardTensor.wrap(total, rows_meta.as_replicated()))


# ---- scatters into node rows ------------------------------------------------------------
def _is_node_scatter(meta, args, kwargs) -> bool:
    if not _rows_meta(meta) or meta.scatter_rule != "distributed":
        return False
    dim, rows = _target_rows(args, kwargs)
    return dim == 0 and rows == meta.n_owned


@register(*SCATTER_OPS, predicate=_is_node_scatter, name="sharded_scatter", first=True)
def sharded_scatter(func, meta: ShardedMeta, args, kwargs):
    """Scatter into owned rows; contributions to request-table rows go to their owners."""
    call = _parse(func, args, kwargs)
    base = local(call.target)
    table = base.new_zeros((meta.plan.n_padded, *base.shape[1:]))
    contribution = call.scatter_into(table, local(call.index), local(call.src))
    out = base + halo_accumulate(contribution, meta.plan)[: meta.n_owned]
    return _finish(call, ShardTensor.wrap(out, meta))


def _is_row_sum(meta, args, kwargs) -> bool:
    x = args[0] if args else kwargs.get("input")
    if not _rows_meta(_meta_of(x)) or x.dim() == 0 or not meta.system_reductions:
        return False
    dims = _sum_dims(args, kwargs)
    return (dims is None or 0 in dims) and meta.row_kind(x.shape[0]) != "other"


@register(torch.Tensor.sum, torch.sum, predicate=_is_row_sum, name="sharded_global_sum", first=True)
def sharded_global_sum(func, meta: ShardedMeta, args, kwargs):
    """A sum over atoms or edges: local partial, then all_reduce; replicated result."""
    x = local(args[0])
    rest = {k: v for k, v in kwargs.items() if k != "input"}
    with torch._C.DisableTorchFunctionSubclass():
        partial = torch.sum(x, *args[1:], **rest)
    return ShardTensor.wrap(all_reduce_sum(partial, meta.group), meta.as_replicated())


# ---- replicated values entering per-rank rows ----------------------------------------
# Handled for every layout by the row boundary in shard/replicated.py (to_rows), which
# reads this layout's ``replicated`` flag.
