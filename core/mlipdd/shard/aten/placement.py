"""Placements of the aten-level ShardTensor: where one tensor's distributed rows are.

# NOTE [aten placements]
Every tensor a distributed forward computes carries one placement (DTensor's model,
with the rows of a halo layout instead of even shards):

* `Rows(dim, kind)`: dimension ``dim`` holds rows of this rank's atoms or edges.
  ``kind`` says what the local rows mean (halo storage: ``[owned | ghost]`` rows):

  - ``GHOSTED`` (atoms-owned+ghost): owned rows and ghost rows, each ghost row a copy
    of its owner's row. What a read by a neighbour's index needs.
  - ``OWNED`` (atoms-owned): the owned rows are right; the ghost rows hold nothing of
    meaning (a nonlinear function of partial rows, computed after summing them).
  - ``SHARES``: each ghost row holds this rank's share of its owner's value (a scatter
    by receiver or sender), the value of an atom is its owned row plus every share of
    it on every rank. The natural result of ``index_add`` into atom rows, and of its
    adjoint, the gradient of an ``index_select``.
  - ``EDGES``: rows this rank computes, each edge on exactly one rank.

  ``group``: consecutive entries per row along ``dim`` (``x.flatten()`` of ``(n, 3)``
  rows: 3). ``values``: what the tensor's VALUES are, for index tensors:
  ``"atoms"`` (local atom row numbers: ``edge_index``) or ``"systems"``
  (``batch.batch``).
* `Replicate()`: the same value on every rank (parameters, plain tensors, a completed
  sum over the rows).

Converting between the atom kinds is a halo exchange (`mlipdd.shard.aten.comm`):
SHARES -> OWNED sums the shares into their owners, OWNED -> GHOSTED copies owners onto
their ghosts, GHOSTED -> SHARES (and -> OWNED) zeroes or ignores the ghost rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GHOSTED = "atoms-owned+ghost"
OWNED = "atoms-owned"
SHARES = "atoms-shares"
EDGES = "edges"
ATOM_KINDS = (GHOSTED, OWNED, SHARES)


@dataclass(frozen=True)
class Rows:
    dim: int
    kind: str
    group: int = 1
    values: str | None = None  # "atoms" | "systems" | None

    def is_replicate(self) -> bool:
        return False

    def is_atoms(self) -> bool:
        return self.kind in ATOM_KINDS

    def moved(self, dim: int, group: int | None = None) -> Rows:
        return replace(self, dim=dim, group=self.group if group is None else group)

    def as_kind(self, kind: str) -> Rows:
        return replace(self, kind=kind)

    def plain_values(self) -> Rows:
        return replace(self, values=None) if self.values is not None else self

    def __str__(self) -> str:
        group = f", {self.group} entries per row" if self.group != 1 else ""
        values = f", values={self.values}" if self.values else ""
        return f"Rows(dim={self.dim}, {self.kind}{group}{values})"


@dataclass(frozen=True)
class Replicate:
    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "Replicate()"


REPLICATE = Replicate()
