"""Where a ShardTensor's rows are: a placement per tensor, carried through every op.

# NOTE [placements]
`ShardMeta` says what one rank's rows are for a whole forward pass (its layout: halo
``[owned | ghost]``, sharded owned rows, ...). A placement says which dimension of ONE
tensor holds those rows:

* `Rows(kind, dim, group)`: dimension ``dim`` holds atom rows (``kind="atoms"``: the
  layout's node rows) or edge rows (``kind="edges"``: rows this rank computes, each edge
  on exactly one rank); ``group`` consecutive entries per row when a reshape merged the
  rows with the dims after them (``x.flatten()`` of ``(n, 3)`` rows: group 3).
  ``values="systems"`` marks an index whose values are system numbers (``batch.batch``),
  so a scatter by it is a per-system reduction whatever the row counts are.
* `Opaque(why)` (``Rows(kind="opaque")``): this rank's values in an arrangement no rule can count: atom rows picked
  or reordered by a rank-local index, one row read by its position (``x[0]``), rows
  merged with a dimension before them. Elementwise math keeps it opaque; a reduction, a
  scatter or an op without a rule on it is refused (``why`` says how it became opaque).
  Shape ops move its dim as they move rows; where that is lost, ``dim`` is None.
* ``stale=True`` (halo atom rows): the owned rows are right, the ghost rows are not
  their owners' values (the rows were computed from a padded neighbour table, which a
  ghost atom has no entries in). Sums count owned rows only and stay exact; a read of
  the rows by index is refused until `mlipdd.shard.refresh_ghosts` copies the owners'
  values onto the ghosts.
* ``partial=True`` (halo atom rows): a gradient by atom rows; every row holds only what
  reaches the atom through this rank's copy, the strategy sums the copies when the model
  returns it (NOTE [partial rows] in `mlipdd.shard.gradients`).

A replicated value (the layout `Replicated`) needs no placement. Placements are
computed by `mlipdd.shard.propagation` from the op and its inputs' placements, never
from a tensor's row count; only a tensor a rule or a strategy wraps without one gets
its placement from the row count of its dim 0, once (`placement_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = ["ATOMS", "EDGES", "SYSTEM_INDEX", "Opaque", "Rows", "describe", "placement_of", "rows_kind", "tensor_args"]


@dataclass(frozen=True)
class Rows:
    kind: str  # "atoms" | "edges" | "opaque"
    dim: int | None = 0  # None: somewhere, no longer known (opaque only)
    group: int = 1
    values: str | None = None  # "systems": an index whose values are system numbers
    stale: bool = False  # halo atom rows whose ghost rows are not their owners' values
    partial: bool = False  # halo atom rows of a gradient: copies' contributions, not yet summed
    why: str = ""  # opaque: how the rows became so

    def leads(self) -> bool:
        """Rows along dim 0, one entry each: the shape every row rule reads."""
        return self.dim == 0 and self.group == 1 and self.kind != "opaque"

    def is_opaque(self) -> bool:
        return self.kind == "opaque"

    def moved(self, dim: int | None, group: int | None = None) -> Rows:
        return replace(self, dim=dim, group=self.group if group is None else group)


def Opaque(why: str, dim: int | None = 0) -> Rows:
    """Rows this rank holds in an arrangement no rule can count (NOTE [placements])."""
    return Rows("opaque", dim, why=why)


ATOMS = Rows("atoms")
EDGES = Rows("edges")
SYSTEM_INDEX = Rows("atoms", values="systems")  # batch.batch: each atom's system number


def placement_of(t):
    """A ShardTensor's placement (`Rows` or `Opaque`); None for a replicated value or a
    plain tensor. A tensor wrapped without one gets it from its dim-0 row count, once."""
    meta = getattr(t, "_meta", None)
    if meta is None or meta.layout.is_replicated():
        return None
    place = getattr(t, "_place", None)
    if place is None:
        place = _from_row_count(t, meta)
        t._place = place
    return place


def _from_row_count(t, meta):
    if t.dim() == 0:
        return Opaque("a value of this rank's rows, reduced on this rank only", None)
    kind = meta.row_kind(t.shape[0])
    if kind == "node":
        return ATOMS
    if kind == "edge":
        return EDGES
    return Opaque(f"{t.shape[0]} rows that are neither this rank's atoms ({meta.n_padded}) nor its edges "
                  f"({meta.n_edges}): rows read by an index of another length, or sliced")


def rows_kind(t, meta) -> str:
    """``node``, ``edge`` or ``other`` for dim 0 of ``t``: a ShardTensor by its placement,
    a plain tensor (an accumulator, an index) by its row count."""
    if getattr(t, "_meta", None) is not None:
        place = placement_of(t)
        if place is None or not place.leads():
            return "other"
        return "node" if place.kind == "atoms" else "edge"
    if t.dim() == 0:
        return "other"
    return meta.row_kind(t.shape[0])


def describe(place) -> str:
    """The placement in words, for error messages."""
    if place is None:
        return "a value replicated on every rank"
    if place.is_opaque():
        return f"rank-local rows ({place.why})"
    what = "atom rows" if place.kind == "atoms" else "edge rows"
    merged = f", {place.group} entries per row" if place.group != 1 else ""
    stale = " (ghost rows not refreshed)" if place.stale else ""
    partial = " (a gradient: each copy's share, not yet summed over ranks)" if place.partial else ""
    return f"{what} along dim {place.dim}{merged}{stale}{partial}"


def tensor_args(args, kwargs):
    """Every tensor among a call's arguments, and in its list or tuple arguments."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))
