"""Neighbour lists for batches of atomic systems, built on vesin.

Convention (ASE's "ijS", the same as `mlipdd.models.base`): ``edge_index[0]`` is the
sender ``i``, ``edge_index[1]`` the receiver ``j``, and the edge vector is
``positions[j] + unit_shifts @ cell - positions[i]``. Indices are global rows of the
batch; each system is searched on its own, so no edge joins two systems.

The list stores *integer* image shifts (in units of cell vectors) rather than
cartesian ones: the cartesian shift is recomputed from the cell on demand
(`NeighborList.shifts`), which keeps it differentiable with respect to the cell, the
route by which the base model gets the stress.

vesin handles every boundary we need (checked against brute force in
tests/test_neighbors.py): fully periodic triclinic cells, cells thinner than twice the
cutoff (an atom then sees several images of itself and of each neighbour), open
boundaries with a zero cell, and mixed periodicity (a slab) where the non-periodic
cell vector may be zero. It runs on CPU and CUDA; the list lives on the batch's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlipdd.data import Batch, InputError

try:  # vesin >= 0.5 ships the TorchScript bindings as their own top-level package
    from vesin_torch import NeighborList as _VesinNeighborList
except ImportError:  # pragma: no cover - older vesin layout
    from vesin.torch import NeighborList as _VesinNeighborList


@dataclass
class NeighborList:
    """A COO neighbour list: ``edge_index`` (2, E) long and ``unit_shifts`` (E, 3).

    ``unit_shifts`` has the positions' float dtype and holds integers (how many cell
    vectors the receiver's image is displaced by). ``cutoff`` is the radius the list
    was built with (cutoff + skin when built through a policy); models keep only the
    edges shorter than their own cutoff. ``reference_positions`` / ``reference_cell``
    are the geometry it was built from (set by `attach_neighbors`). ``padded``: the list
    has the fixed size of a CUDA graph's buffers, its unused slots holding null edges
    longer than ``cutoff`` (`mlipdd.distributed.cuda_graph`); a model keeps every edge of
    such a list (filtering would change its size) and gives the long ones zero weight.
    """

    edge_index: torch.Tensor
    unit_shifts: torch.Tensor
    cutoff: float | None = None
    full_list: bool = True
    reference_positions: torch.Tensor | None = None
    reference_cell: torch.Tensor | None = None
    padded: bool = False

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.shape[1])

    @property
    def senders(self) -> torch.Tensor:
        return self.edge_index[0]

    @property
    def receivers(self) -> torch.Tensor:
        return self.edge_index[1]

    def edge_system(self, batch_index: torch.Tensor) -> torch.Tensor:
        """The system each edge belongs to (that of its receiver)."""
        return batch_index.index_select(0, self.edge_index[1])

    def shifts(self, cell: torch.Tensor, batch_index: torch.Tensor) -> torch.Tensor:
        """Cartesian image shifts (E, 3) = unit_shifts @ cell of the edge's system.

        Differentiable with respect to ``cell`` (n_systems, 3, 3).
        """
        unit_shifts = self.unit_shifts.to(cell.dtype)
        if cell.shape[0] == 1:  # one system: a plain (E, 3) @ (3, 3), far cheaper than a bmm
            return unit_shifts @ cell[0]
        if self.num_edges == 0:
            return unit_shifts.new_zeros((0, 3))
        edge_cells = cell.index_select(0, self.edge_system(batch_index))
        return torch.einsum("ei,eij->ej", unit_shifts, edge_cells)

    def edge_vectors(
        self, positions: torch.Tensor, cell: torch.Tensor, batch_index: torch.Tensor
    ) -> torch.Tensor:
        """Vectors from sender to receiver image, ``pos[j] + shift - pos[i]``."""
        sender, receiver = self.edge_index[0], self.edge_index[1]
        return (
            positions.index_select(0, receiver)
            + self.shifts(cell, batch_index)
            - positions.index_select(0, sender)
        )

    def select(self, mask: torch.Tensor) -> NeighborList:
        """The edges where ``mask`` (E,) holds; references and cutoff are kept."""
        return NeighborList(
            self.edge_index[:, mask],
            self.unit_shifts[mask],
            self.cutoff,
            self.full_list,
            self.reference_positions,
            self.reference_cell,
        )

    def to(self, device) -> NeighborList:
        def move(t):
            return None if t is None else t.to(device)

        return NeighborList(
            self.edge_index.to(device),
            self.unit_shifts.to(device),
            self.cutoff,
            self.full_list,
            move(self.reference_positions),
            move(self.reference_cell),
            self.padded,
        )


def build_neighbor_list(batch: Batch, cutoff: float, full_list: bool = True) -> NeighborList:
    """All pairs closer than ``cutoff`` in every system of ``batch`` (global atom indices).

    A full list holds each pair in both directions; a half list (``full_list=False``)
    holds each once. Edges are sorted by receiver, then sender, then shift, so the
    result does not depend on the library's internal order.
    """
    cutoff = float(cutoff)
    if not cutoff > 0:
        raise InputError(
            f"neighbour-list cutoff must be positive, got {cutoff}; pass the model's cutoff"
        )
    positions = _plain(batch.positions).detach()
    cell = _plain(batch.cell).detach().to(positions.dtype)
    pbc = _plain(batch.pbc).to(torch.bool)
    system_of_atom = _plain(batch.batch)
    dtype, device = positions.dtype, positions.device

    calculator = _VesinNeighborList(cutoff=cutoff, full_list=full_list)
    edges, shifts = [], []
    if batch.num_systems == 1:
        rows_of_system = [None]
    else:  # one stable sort groups the rows of each system (rows need not be contiguous)
        counts = torch.bincount(system_of_atom, minlength=batch.num_systems).tolist()
        rows_of_system = torch.sort(system_of_atom, stable=True).indices.split(counts)
    for s, rows in enumerate(rows_of_system):
        _check_periodic_cell(cell[s], pbc[s], s)
        points = positions if rows is None else positions.index_select(0, rows)
        if points.shape[0] == 0:
            continue
        i, j, unit = calculator.compute(points, cell[s], pbc[s].cpu(), "ijS")
        pair = torch.stack(
            [i.to(device=device, dtype=torch.long), j.to(device=device, dtype=torch.long)]
        )
        if rows is not None:
            pair = rows[pair]
        edges.append(pair)
        shifts.append(unit.to(device=device, dtype=torch.long))
    if len(edges) == 1:
        edge_index, unit_shifts = edges[0], shifts[0]
    elif edges:
        edge_index, unit_shifts = torch.cat(edges, dim=1), torch.cat(shifts)
    else:
        edge_index = torch.zeros((2, 0), dtype=torch.long, device=device)
        unit_shifts = torch.zeros((0, 3), dtype=torch.long, device=device)
    edge_index, unit_shifts = _sorted_edges(edge_index, unit_shifts, batch.num_atoms)
    return NeighborList(edge_index, unit_shifts.to(dtype), cutoff, full_list)


def attach_neighbors(batch: Batch, cutoff: float, full_list: bool = True) -> NeighborList:
    """Build a list, store it as ``batch.neighbors`` with the geometry it came from."""
    neighbors = build_neighbor_list(batch, cutoff, full_list)
    neighbors.reference_positions = _plain(batch.positions).detach().clone()
    neighbors.reference_cell = _plain(batch.cell).detach().clone()
    batch.neighbors = neighbors
    return neighbors


class NeighborListPolicy:
    """When to rebuild a Verlet list built with ``cutoff + skin``.

    A list built with a skin stays valid (holds every pair within ``cutoff``) until
    some atom has moved more than ``skin / 2``: two atoms approaching each other can
    then close at most ``skin`` of distance. A changed cell (a barostat) keeps it while
    `strained_list_invalid` says it holds; a changed periodicity or atom set invalidates it. `needs_rebuild` is a rank-local answer; a distributed
    runtime reduces it across ranks before acting on it.
    """

    def __init__(self, cutoff: float, skin: float = 0.0, full_list: bool = True):
        if skin < 0:
            raise InputError(f"skin must be >= 0, got {skin}; use 0 to rebuild every step")
        self.cutoff = float(cutoff)
        self.skin = float(skin)
        self.full_list = full_list
        self._positions: torch.Tensor | None = None
        self._cell: torch.Tensor | None = None
        self._pbc: torch.Tensor | None = None
        self._atom_ids: torch.Tensor | None = None
        self.num_builds = 0

    @property
    def build_cutoff(self) -> float:
        return self.cutoff + self.skin

    def build(self, batch: Batch) -> NeighborList:
        """Build with ``cutoff + skin``, attach to the batch and remember the geometry."""
        neighbors = attach_neighbors(batch, self.build_cutoff, self.full_list)
        self._positions = neighbors.reference_positions
        self._cell = neighbors.reference_cell
        self._pbc = _plain(batch.pbc).clone()
        self._atom_ids = _plain(batch.atom_ids).clone()
        self.num_builds += 1
        return neighbors

    def needs_rebuild(self, batch: Batch) -> bool:
        if self._positions is None:
            return True
        positions = _plain(batch.positions).detach()
        if positions.shape != self._positions.shape:
            return True
        if not torch.equal(_plain(batch.atom_ids), self._atom_ids):
            return True
        if not torch.equal(_plain(batch.pbc), self._pbc):
            return True
        if positions.shape[0] == 0:
            return False
        cell = _plain(batch.cell).detach()
        if torch.equal(cell, self._cell):
            displacement = (positions - self._positions).norm(dim=1).max()
            return bool(displacement > 0.5 * self.skin)
        return strained_list_invalid(positions, cell, self._positions, self._cell,
                                     _plain(batch.batch), self.cutoff, self.skin)

    def update(self, batch: Batch) -> tuple[NeighborList, bool]:
        """Rebuild when needed; returns the current list and whether it was rebuilt."""
        if self.needs_rebuild(batch):
            return self.build(batch), True
        neighbors = batch.neighbors
        if neighbors is None:  # same geometry but a fresh batch object: rebuild to attach
            return self.build(batch), True
        return neighbors, False


def strained_list_invalid(positions, cell, ref_positions, ref_cell, system_of_atom,
                          cutoff: float, skin: float) -> bool:
    """Whether a list built at (``ref_positions``, ``ref_cell``) with ``cutoff + skin`` may
    now miss a pair within ``cutoff``, after the atoms moved AND the cell changed (a
    barostat strains it every step).

    NOTE [skin under strain]: the list stores image shifts, not vectors, so a listed pair's
    distance is always recomputed from today's cell. Only unlisted pairs matter. Write
    today's cell as ``h = h0 M`` (``M`` the strain since the build) and map each atom back
    to the reference cell through its fractional coordinates, ``x' = x h^-1 h0``; a pair's
    vector is then ``d = d' M``, with ``|d' - d0| <= 2 delta`` (``delta`` the largest
    displacement in the reference frame). An unlisted pair had ``|d0| > cutoff + skin``, so
    ``|d| >= s_min(M) (cutoff + skin - 2 delta)``, ``s_min`` the smallest singular value of
    ``M``. The list holds while that is at least ``cutoff``:
    ``delta <= (cutoff + skin - cutoff / s_min) / 2``, which is ``skin / 2`` without strain.
    A cell that cannot be inverted (a non-periodic axis without a vector) rebuilds.
    """
    if bool((torch.linalg.det(cell).abs() < 1e-12).any()) or bool(
        (torch.linalg.det(ref_cell).abs() < 1e-12).any()
    ):
        return True
    strain = torch.linalg.solve(ref_cell, cell)  # M per system: h0 M = h
    smallest = torch.linalg.svdvals(strain).min(dim=-1).values
    back = torch.linalg.solve(strain, torch.eye(3, dtype=cell.dtype, device=cell.device))  # M^-1
    mapped = torch.einsum("ni,nij->nj", positions, back[system_of_atom])
    delta = (mapped - ref_positions).norm(dim=1)
    allowed = 0.5 * (cutoff + skin - cutoff / smallest)  # per system; negative: strained too far
    return bool((delta > allowed[system_of_atom]).any() | (allowed <= 0).any())


# ---- helpers -------------------------------------------------------------------------


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor as a plain `torch.Tensor` (a ShardTensor's local rows, untouched)."""
    return t if type(t) is torch.Tensor else t.as_subclass(torch.Tensor)


def _check_periodic_cell(cell: torch.Tensor, pbc: torch.Tensor, system: int) -> None:
    lengths = cell.norm(dim=1)
    for axis in range(3):
        if bool(pbc[axis]) and float(lengths[axis]) == 0.0:
            raise InputError(
                f"system {system}: axis {'abc'[axis]} is periodic but its cell vector is zero; "
                "give a cell vector for every periodic axis or set pbc False along it"
            )


def _sorted_edges(edge_index: torch.Tensor, unit_shifts: torch.Tensor, num_atoms: int):
    """Sort by (receiver, sender, shift).

    (i, j, shift) is unique per edge, so one sort of a packed int64 key gives a total
    order; two stable sorts do the same when the key would overflow.
    """
    if edge_index.shape[1] == 0:
        return edge_index, unit_shifts
    low = unit_shifts.min(dim=0).values
    span = (unit_shifts.max(dim=0).values - low + 1).tolist()
    weights = torch.tensor([span[1] * span[2], span[2], 1], device=unit_shifts.device)
    shift_key = ((unit_shifts - low) * weights).sum(dim=1)
    n = max(num_atoms, 1)
    pair_key = edge_index[1] * n + edge_index[0]
    num_shift_keys = span[0] * span[1] * span[2]
    if n * n * num_shift_keys < 2**62:
        order = torch.sort(pair_key * num_shift_keys + shift_key).indices
    else:
        order = torch.sort(shift_key, stable=True).indices
        order = order.index_select(
            0, torch.sort(pair_key.index_select(0, order), stable=True).indices
        )
    return edge_index.index_select(1, order), unit_shifts.index_select(0, order)
