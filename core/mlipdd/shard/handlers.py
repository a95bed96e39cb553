"""Dispatch rules for halo storage (`Halo` layout): scatters, per-system reductions,
sums, gathers; plus the scatter-call parsing the other layouts' rules share.

Each handler receives ``(func, meta, args, kwargs)`` and computes on plain tensors
(`local`), so nothing in here re-enters the dispatch. Which rule wins is stated in
`mlipdd.shard.registry.PRECEDENCE`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mlipdd.shard.exchange import all_reduce_sum, halo_correct
from mlipdd.shard.layouts import Halo
from mlipdd.shard.placement import ATOMS, EDGES, Opaque, Rows, describe, placement_of, rows_kind
from mlipdd.shard.propagation import NoRuleError, op_name
from mlipdd.shard.registry import register
from mlipdd.shard.replicated import replicated
from mlipdd.shard.tensor import ShardMeta, ShardTensor, local, poison


@dataclass
class ScatterCall:
    """One scatter-like call, normalised: ``target`` receives ``src`` rows at ``index``."""

    name: str
    target: torch.Tensor
    dim: int
    index: torch.Tensor
    src: torch.Tensor
    inplace: bool
    alpha: object = 1
    reduce: str = "sum"
    include_self: bool = True

    def scatter_into(self, base: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """The same scatter, out of place, on plain tensors."""
        if self.name.startswith("index_add"):
            return base.index_add(self.dim, index, src, alpha=self.alpha)
        if self.name.startswith("scatter_reduce"):
            return base.scatter_reduce(self.dim, index, src, "sum", include_self=True)
        return base.scatter_add(self.dim, index, src)


def _parse(func, args, kwargs) -> ScatterCall:
    name = func.__name__
    names = ["target", "dim", "index", "src"]
    values = dict(zip(names, args))
    for key, alias in (("target", "input"), ("src", "source"), ("target", "self")):
        if alias in kwargs:
            values[key] = kwargs[alias]
    for key in names:
        if key in kwargs:
            values[key] = kwargs[key]
    if "scatter_reduce" in name:
        reduce = args[4] if len(args) > 4 else kwargs.get("reduce")
        if reduce != "sum" and reduce != "add":
            raise NotImplementedError(
                f"scatter_reduce(reduce={reduce!r}) on a ShardTensor: 'sum' has a cross-rank rule, "
                "and 'mean' along dim 0 into atom rows; give the model an OpAdapter for this "
                "reduction or use scatter_add"
            )
        if not kwargs.get("include_self", True):
            raise NotImplementedError(
                "scatter_reduce(include_self=False) on a ShardTensor has no halo rule; "
                "scatter into a zero tensor with include_self=True instead"
            )
    dim = values["dim"]
    target = values["target"]
    dim = dim + target.dim() if dim < 0 else dim
    return ScatterCall(
        name=name,
        target=target,
        dim=dim,
        index=values["index"],
        src=values["src"],
        inplace=name.endswith("_"),
        alpha=kwargs.get("alpha", 1),
    )


SCATTER_OPS = (
    torch.Tensor.scatter_add,
    torch.Tensor.scatter_add_,
    torch.scatter_add,
    torch.Tensor.index_add,
    torch.Tensor.index_add_,
    torch.index_add,
    torch.Tensor.scatter_reduce,
    torch.Tensor.scatter_reduce_,
    torch.scatter_reduce,
)


def _target_rows(args, kwargs) -> tuple[int, int]:
    target = args[0] if args else kwargs.get("input", kwargs.get("self"))
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    dim = dim + target.dim() if dim < 0 else dim
    return dim, target.shape[dim]


def _index_of(args, kwargs):
    return args[2] if len(args) > 2 else kwargs.get("index")


def by_system_index(args, kwargs) -> bool:
    """The scatter's index holds system numbers (``batch.batch``): a per-system reduction,
    whatever the row counts (a rank may hold as many atoms as there are systems)."""
    place = placement_of(_index_of(args, kwargs))
    return place is not None and place.values == "systems"


def _is_node_scatter(func, meta: ShardMeta, args, kwargs) -> bool:
    dim, rows = _target_rows(args, kwargs)
    return (dim == 0 and rows == meta.n_padded and meta.layout.correct_scatters
            and not by_system_index(args, kwargs))


def _is_system_scatter(func, meta: ShardMeta, args, kwargs) -> bool:
    dim, rows = _target_rows(args, kwargs)
    return dim == 0 and (rows == meta.n_systems or by_system_index(args, kwargs)) and meta.system_reductions


def _finish(call: ScatterCall, result: torch.Tensor) -> torch.Tensor:
    if call.inplace:
        poison(call.target, call.name)
    return result


@register(Halo, *SCATTER_OPS, predicate=_is_node_scatter, name="halo_scatter")
def halo_scatter(func, meta: ShardMeta, args, kwargs):
    """Scatter into ``[owned | ghost]`` rows: local partials, then reverse + forward exchange."""
    call = _parse(func, args, kwargs)
    base = local(call.target)
    rows = _counted_rows(meta, call.src, call.name)  # a ghost row's value is its owner's: counted there
    contribution = call.scatter_into(torch.zeros_like(base), local(call.index)[rows], local(call.src)[rows])
    out = base + halo_correct(contribution, meta.plan)
    return _finish(call, ShardTensor.wrap(out, meta, ATOMS))


def refuse_opaque_source(call: ScatterCall, meta: ShardMeta) -> None:
    """A scatter whose source rows no rule can count (NOTE [placements]) is refused."""
    place = placement_of(call.src)
    if place is not None and place.is_opaque():
        _counted_rows(meta, call.src, call.name)


def _counted_rows(meta: ShardMeta, t, what: str) -> slice:
    """The rows of ``t`` that count towards a sum over all ranks: owned atoms (a ghost row
    mirrors an atom counted on its owner's rank), or every edge (each on one rank)."""
    kind = rows_kind(t, meta)
    if kind == "node":
        return slice(0, meta.n_owned)
    if kind == "edge":
        return slice(0, t.shape[0])
    place = placement_of(t)
    raise NoRuleError(
        f"{what} over {describe(place) if place is not None else f'{t.shape[0]} plain rows'}: they are neither "
        f"this rank's atoms ({meta.n_padded} rows here) nor its edges ({meta.n_edges}), so which of them "
        "count towards the total over ranks is unknown; reduce a per-atom or per-edge tensor (NOTE "
        "[placements] in mlipdd.shard.placement)"
    )


@register(Halo, *SCATTER_OPS, predicate=_is_system_scatter, name="per_system_reduce")
def per_system_reduce(func, meta: ShardMeta, args, kwargs):
    """Scatter into one slot per system: owned rows locally, then all_reduce (replicated)."""
    call = _parse(func, args, kwargs)
    src, index = local(call.src), local(call.index)
    rows = _counted_rows(meta, call.src, call.name)
    base = local(call.target)
    partial = call.scatter_into(torch.zeros_like(base), index[rows], src[rows])
    return _finish(call, replicated(base + all_reduce_sum(partial, meta.group), meta))


def _sum_dims(args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(d + x.dim() if d < 0 else d for d in dims)


def _is_row_sum(func, meta: ShardMeta, args, kwargs) -> bool:
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, ShardTensor) or x.dim() == 0 or not meta.system_reductions:
        return False
    dims = _sum_dims(args, kwargs)
    return (dims is None or 0 in dims) and rows_kind(x, meta) != "other"


@register(Halo, torch.Tensor.sum, torch.sum, predicate=_is_row_sum, name="global_sum")
def global_sum(func, meta: ShardMeta, args, kwargs):
    """A sum over atoms or edges: counted rows locally, then all_reduce (replicated)."""
    rows = _counted_rows(meta, args[0], "sum")
    x = local(args[0])
    rest = {k: v for k, v in kwargs.items() if k != "input"}
    with torch._C.DisableTorchFunctionSubclass():
        partial = torch.sum(x[rows], *args[1:], **rest)
    # NOTE [whole sums are replicated]: the total is the same on every rank and marked so.
    # A model that feeds it back into its rows (``q - q.sum() / n``, a single system's
    # charge neutrality) then gets its gradient shares summed over ranks (NOTE
    # [replicated gradients]); a plain total silently gave each rank only its own share.
    # mace's ``positions.sum() * 0`` (it keeps the strain in the graph) stays plain by
    # `zero_product`, so its virial is still this rank's share, summed once by the strategy.
    return replicated(all_reduce_sum(partial, meta.group), meta)


def _read_index(func, args, kwargs):
    """The integer index of a read along dim 0 (``x[idx]``, ``x[idx, ...]``, index_select(0, idx))."""
    if func is torch.Tensor.__getitem__:
        item = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
        return item if isinstance(item, torch.Tensor) and item.dim() > 0 and item.dtype != torch.bool else None
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return _index_of(args, kwargs) if dim == 0 else None


def _is_halo_read(func, meta: ShardMeta, args, kwargs) -> bool:
    x = args[0] if args else None
    return (isinstance(x, ShardTensor) and x.dim() > 0 and rows_kind(x, meta) == "node"
            and _read_index(func, args, kwargs) is not None)


@register(Halo, torch.Tensor.index_select, torch.index_select, torch.Tensor.__getitem__,
          predicate=_is_halo_read, name="halo_read")
def halo_read(func, meta: ShardMeta, args, kwargs):
    """Reading atom rows by index: ghost rows are kept current by the scatters, so this
    stays local. Rows read by a padded table of neighbours (an index of ``n_atoms x k``)
    are the atoms' own, with ghost rows that are not (NOTE [placements])."""
    x, index = args[0], _read_index(func, args, kwargs)
    if placement_of(x).stale:
        raise NoRuleError(
            f"`{op_name(func)}` reads {describe(placement_of(x))} by index: a ghost row here holds a value "
            "computed on this rank from its few local neighbours, not its owner's. Refresh the ghost rows "
            "first with `x = mlipdd.shard.refresh_ghosts(x)` (a halo exchange; a no-op on one process), or "
            "run the model with sharded storage (DomainConfig(strategy='sharded'))."
        )
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    if not isinstance(out, torch.Tensor):
        return out
    return ShardTensor.wrap(out, meta, read_placement(x, index, meta, padded_table=Rows("atoms", stale=True)))


def read_placement(x, index, meta: ShardMeta, padded_table):
    """The rows of ``x[index]``: those of the index (a per-edge index reads edge rows),
    carrying what ``x``'s values mean (a system index read per edge is still one). A
    2-D index with a row per atom is a padded table of neighbours: ``padded_table``."""
    values = placement_of(x).values
    place = placement_of(index)
    if index.dim() > 1 and index.shape[0] == meta.n_padded and (place is None or place.is_opaque()):
        return padded_table
    if place is None:  # a plain index: by its row count
        kind = rows_kind(index, meta)
        place = {"node": ATOMS, "edge": EDGES}.get(kind)
        if place is None:
            return Opaque("atom rows read by a plain index that is neither per atom nor per edge", 0)
    if place.dim != 0:
        return Opaque("atom rows read by an index whose rows are not along its dim 0", None)
    return replace(place, values=values)
