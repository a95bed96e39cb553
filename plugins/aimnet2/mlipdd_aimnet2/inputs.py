"""An mlipdd batch as the input dict of aimnet's flat neighbour-matrix layout (``nb_mode`` 1).

aimnet reads neighbours through a receiver-major matrix: row ``i`` lists the neighbours
of atom ``i`` (``nbmat`` (N, M)), padded slots are masked (``mask_ij``), and a sum over
neighbours is a contraction over the slot dimension, not a scatter. The matrix is built
here from mlipdd's COO list (integer bookkeeping on plain tensors). Two differences from
aimnet's own calculator, both invisible to its equations:

* no trailing padding atom: padded slots point at the row itself and are masked, and
  the dict says the input is not padded (``_input_padded`` False), so aimnet never
  masks "the last row" (which here is a real atom);
* the short-range network and the Coulomb sum get separate matrices cut from one list
  (the Coulomb cutoff may be longer than the network's).

Under domain decomposition the rows are this rank's rows and a neighbour index may
point at a remote atom; aimnet's ``index_select`` reads are then routed by the
ShardTensor dispatch, and nothing here changes.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from mlipdd.data import Batch
from mlipdd.distributed.compiled_sums import OWNED_ROWS
from mlipdd.shard import as_atom_rows, local
from mlipdd.shard.aten import ShardTensor as AtenRows


# NOTE [aimnet's Warp convolution]: on CUDA in float32 aimnet's `ConvSV.forward` calls the
# Warp kernel `conv_sv_2d_sp(a, nbmat, g)` instead of its einsum, and the kernel's defaults
# are aimnet's padded layout: the LAST ROW is the padding atom (never computed as a centre)
# and any index >= it is a sentinel that ends the row's scan. In this layout the last row is
# a real atom: left to the defaults, that atom's environment is zero and every row listing
# it loses it and the neighbours after it (measured on an H200: 0.07 eV, 0.7 eV/A, 0.1 e off
# aimnet's calculator; CPU never takes the branch). Inside `explicit_convolution_rows`, the
# kernel is told that every row is a centre and no index is a sentinel (padded slots point
# at the row itself with a zero basis, as the einsum reads them); a ShardTensor (DD) takes
# the einsum, whose reads the dispatch routes (the kernel would read local rows only).
def _convolution_without_padding_row(original):
    def convolution(a, idx, g, padding_value=None, num_centers=None, transpose=None):
        if type(a) is not torch.Tensor or type(idx) is not torch.Tensor:
            a_j = a.index_select(0, idx.flatten()).unflatten(0, idx.shape)
            return torch.einsum("...mag,...mgd->...agd", a_j, g)
        # (the deterministic transpose is the calculator's, built for its padded layout: never set here)
        return original(a, idx, g, padding_value=a.shape[0], num_centers=idx.shape[0])
    return convolution


@contextlib.contextmanager
def explicit_convolution_rows():
    """aimnet's network reads this layout right on every device (NOTE [aimnet's Warp convolution])."""
    from aimnet.modules import aev

    original = aev.conv_sv_2d_sp
    aev.conv_sv_2d_sp = _convolution_without_padding_row(original)
    try:
        yield
    finally:
        aev.conv_sv_2d_sp = original


@dataclass
class NeighborMatrix:
    """Receiver-major neighbours: ``index`` (N, M) long, ``unit_shifts`` (N, M, 3), ``pad`` (N, M)."""

    index: torch.Tensor
    unit_shifts: torch.Tensor
    pad: torch.Tensor


def neighbor_matrix(sender: torch.Tensor, receiver: torch.Tensor, unit_shifts: torch.Tensor,
                    n_rows: int) -> NeighborMatrix:
    """Row ``receiver[e]`` lists ``sender[e]`` with aimnet's shift sign (``x_j + s @ cell - x_i``).

    mlipdd's edge vector is ``x[receiver] + u @ cell - x[sender]``; seen from the receiver,
    the neighbour sits at ``x[sender] - u @ cell``, so the matrix stores ``-u``.
    """
    device = receiver.device
    # mlipdd's lists come sorted by receiver (and a mask keeps the order): checking is a
    # tenth of the cost of sorting two million edges again
    if receiver.numel() > 1 and not bool((receiver[1:] >= receiver[:-1]).all()):
        order = torch.argsort(receiver, stable=True)
        receiver, sender, unit_shifts = receiver[order], sender[order], unit_shifts[order]
    counts = torch.bincount(receiver, minlength=n_rows)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    start = torch.cumsum(counts, 0) - counts
    slot = torch.arange(receiver.numel(), device=device) - start[receiver]
    index = torch.arange(n_rows, device=device).unsqueeze(1).repeat(1, width)
    index[receiver, slot] = sender
    shifts = unit_shifts.new_zeros((n_rows, width, 3))
    shifts[receiver, slot] = -unit_shifts
    pad = torch.ones((n_rows, width), dtype=torch.bool, device=device)
    pad[receiver, slot] = False
    return NeighborMatrix(index, shifts, pad)


def edge_lengths(positions: torch.Tensor, cell: torch.Tensor, system: torch.Tensor,
                 edge_index: torch.Tensor, unit_shifts: torch.Tensor) -> torch.Tensor:
    """Plain, detached edge lengths, for choosing which edges each matrix keeps.

    Bookkeeping, not physics: no autograd. The sender rows are read through the normal
    indexing (under sharded storage a remote sender's row is fetched from its owner), and
    the result is taken back to a plain tensor.
    """
    with torch.no_grad():
        sender, receiver = edge_index[0], edge_index[1]
        pos = positions.detach()
        cell = local(cell.detach())
        if cell.shape[0] == 1:  # one system: one (E, 3) x (3, 3) product, no per-edge copy of the cell
            cart = unit_shifts.to(pos.dtype) @ cell[0]
        else:
            cart = torch.einsum("ei,eij->ej", unit_shifts.to(pos.dtype), cell[system[receiver]])
        vectors = pos.index_select(0, receiver) + cart - pos.index_select(0, sender)
        return local(torch.linalg.vector_norm(vectors, dim=1))


# NOTE [shifts in aimnet's flat layout]: given cells of shape (B, 3, 3), aimnet turns the
# integer shifts into vectors with one 3x3 cell per atom (``cell[mol_idx]``, a batched
# product over every slot of the matrix); through the Coulomb matrix (N x 1100 slots at
# 15 A) that product and its backward doubled the network's time. One system hands aimnet
# its (3, 3) cell, as aimnet's calculator does; several get the vectors computed here,
# three broadcast products against each atom's cell rows, and an identity cell.
def _cell_for_aimnet(cell: torch.Tensor) -> torch.Tensor:
    if cell.shape[0] == 1:
        return cell[0]
    return torch.eye(3, dtype=cell.dtype, device=cell.device)


def _shifts_for_aimnet(unit_shifts: torch.Tensor, cell: torch.Tensor, system: torch.Tensor) -> torch.Tensor:
    if cell.shape[0] == 1:
        return unit_shifts
    rows = cell.index_select(0, system)  # (N, 3, 3): each atom's cell vectors
    return sum(unit_shifts[..., k:k + 1] * rows[:, k:k + 1, :] for k in range(3))


def aimnet_inputs(batch: Batch, positions: torch.Tensor, cell: torch.Tensor, charge: torch.Tensor,
                  short_cutoff: float, long_cutoff: float | torch.Tensor | None,
                  matrices: dict[str, NeighborMatrix] | None = None, images: torch.Tensor | None = None,
                  open_batch: bool = False) -> dict:
    """aimnet's input dict (flat layout, already "prepared") for ``positions`` / ``cell``.

    ``positions`` and ``cell`` may be the strained copies of the batch's (stress). Edges
    longer than ``short_cutoff`` are left out of ``nbmat`` (the network's matrix); with a
    ``long_cutoff`` (one for all, or one per system) the Coulomb matrix ``nbmat_lr`` keeps
    the edges within it. ``matrices`` (``{suffix: NeighborMatrix}``, from
    `own_neighbors.aimnet_kernel_matrices`) replace the ones cut from ``batch.neighbors``;
    their shifts hold for ``positions - images @ cell`` (a translation by whole cell
    vectors: the same energy, and the same gradient with respect to ``positions``).
    ``open_batch``: no system is periodic, so every shift is zero and aimnet is given none
    (as its calculator gives a molecule none): its ``coord_j + shifts @ cell`` over every slot,
    and the products that turn shifts into vectors, are 16 launches a call on a GPU.
    """
    if images is not None:
        positions = positions - torch.einsum("ni,nij->nj", images.to(positions.dtype), cell[batch.batch])
    data = {
        "coord": positions,
        "numbers": batch.atomic_numbers,
        "charge": charge,
        "cell": _cell_for_aimnet(cell),
        "mol_idx": batch.batch,
        "_nb_mode": torch.tensor(1),
        "_input_padded": torch.tensor(False),
        "_num_mol": torch.tensor(batch.num_systems),
    }
    if OWNED_ROWS in batch.node:  # compiled at several ranks: which rows the sums count (`adapters`)
        data[OWNED_ROWS] = batch.node[OWNED_ROWS]
    if matrices is None:
        matrices = _matrices_from_list(batch, positions, short_cutoff, long_cutoff)
    for suffix, matrix in matrices.items():
        # a ghost atom has no edges here: its row of the table is padding (refreshed after
        # each convolution, `mlipdd_aimnet2.adapters`)
        data[f"nbmat{suffix}"] = as_atom_rows(matrix.index, positions, ghosts_current=False, index=True)
        unit_shifts, pad = _table_rows(matrix.unit_shifts, positions), _table_rows(matrix.pad, positions)
        if not open_batch:
            data[f"shifts{suffix}"] = _shifts_for_aimnet(unit_shifts, cell, batch.batch)
        data[f"mask_ij{suffix}"] = pad
        # integer cell shifts of each slot, for nvalchemiops' kernels at one process (which
        # take shifts in cell units and one cell per system; aimnet's "shifts" may be vectors)
        data[f"_unit_shifts{suffix}"] = unit_shifts
    return data


def _table_rows(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A table's slot values as atom rows (NOTE [declared rows]: the rows of this rank's
    receivers)."""
    return as_atom_rows(t, positions, ghosts_current=False) if isinstance(positions, AtenRows) else t


def _matrices_from_list(batch: Batch, positions: torch.Tensor, short_cutoff: float,
                        long_cutoff: float | torch.Tensor | None, margin: float = 0.0) -> dict[str, NeighborMatrix]:
    """The network's matrix and the Coulomb one, cut from the batch's COO list by length
    (``cutoff + margin``: `ListMatrices` keeps the edges a list's skin may bring inside)."""
    neighbors = batch.neighbors
    edge_rows = neighbors.edge_index.to(positions.device)
    shift_rows = neighbors.unit_shifts.to(device=positions.device, dtype=positions.dtype)
    n_rows = positions.shape[0]
    lengths = edge_lengths(batch.positions, batch.cell, batch.batch, edge_rows, shift_rows)
    # the tables are bookkeeping on this rank's edges, each receiver's edges all here (NOTE
    # [declared rows] in mlipdd.shard.aten.tensor): plain local tensors, declared rows after
    edge_index, unit_shifts, system = local(edge_rows), local(shift_rows), local(batch.batch)
    # a zero-length self edge (i, i, no shift) is not a neighbour
    self_edge = (edge_index[0] == edge_index[1]) & (unit_shifts == 0).all(dim=1)
    matrices = {}
    for suffix, cutoff in (("", short_cutoff), ("_lr", long_cutoff)):
        if cutoff is None:
            continue
        if isinstance(cutoff, torch.Tensor):
            cutoff = local(cutoff)[system[edge_index[1]]]
        keep = (lengths < cutoff + margin) & ~self_edge
        if bool(keep.all()):  # the Coulomb matrix often keeps every edge: no copy of them
            matrix = neighbor_matrix(edge_index[0], edge_index[1], unit_shifts, n_rows)
        else:
            matrix = neighbor_matrix(edge_index[0][keep], edge_index[1][keep], unit_shifts[keep], n_rows)
        matrices[suffix] = matrix
    return matrices


# NOTE [matrices while the list holds]. In dynamics one list (built with a skin) serves many
# steps, and cutting aimnet's two matrices from it walked every pair of the deep Coulomb list
# each step (two million at 15 A for 2000 atoms: lengths, a mask, a regrouping). At one
# process `ListMatrices` cuts them once per list, at ``cutoff + 2 skin`` (an atom moves at most
# skin/2 from where the list was built, so no pair farther than that at the cut comes inside a
# cutoff while the list holds), and per step only:
# * the network's matrix is compacted to the pairs inside ``short_cutoff`` now (a walk over its
#   own slots, not the list's), kept in list order: the matrix the list would give, bit for bit;
# * the Coulomb matrix is used as cut: its extra pairs lie beyond the Coulomb cutoff, where
#   DSF reads zero (``d < cutoff`` in the closed form, the cutoff in nvalchemiops' kernel) and
#   the all-pairs sum of a molecule lists every pair anyway; with Ewald in the batch it is
#   compacted too (nvalchemiops' real-space kernel sums every slot it is given).
# Without a skin (a list built at the model's cutoff) the cut is the one the list gives, kept
# while the same list comes back. Under DD (ShardTensors, or the plain rows of compiled ranks) and
# inside a torch.compile trace: not cached.
class ListMatrices:
    """aimnet's matrices of the last list seen, kept while that list is the batch's (one entry)."""

    def __init__(self):
        self._list = None  # weak reference to the list's edge index
        self._key = None
        self._matrices = None

    def get(self, batch: Batch, positions: torch.Tensor, short_cutoff: float,
            long_cutoff: float | torch.Tensor | None, model_cutoff: float,
            exact_long: bool) -> dict[str, NeighborMatrix] | None:
        """The matrices for this call, or None where the cache does not apply (no list, DD, a
        CUDA-graph list). ``exact_long``: compact the Coulomb matrix to its cutoff as well."""
        neighbors = batch.neighbors
        if (neighbors is None or neighbors.padded or neighbors.cutoff is None or type(positions) is not torch.Tensor
                or OWNED_ROWS in batch.node or torch.compiler.is_compiling()):  # DD, compiled ranks, a trace
            return None
        skin = max(float(neighbors.cutoff) - model_cutoff, 0.0)
        edge_index = neighbors.edge_index
        key = (edge_index._version, positions.shape[0], positions.dtype, positions.device, short_cutoff,
               long_cutoff if not isinstance(long_cutoff, torch.Tensor) else tuple(long_cutoff.tolist()))
        if self._list is None or self._list() is not edge_index or self._key != key:
            self._matrices = _matrices_from_list(batch, positions, short_cutoff, long_cutoff, margin=2.0 * skin)
            self._list, self._key = weakref.ref(edge_index), key
        if skin == 0.0:
            return self._matrices
        matrices = {**self._matrices, "": _within(self._matrices[""], batch, short_cutoff)}
        if exact_long and "_lr" in matrices:
            matrices["_lr"] = _within(matrices["_lr"], batch, long_cutoff)
        return matrices


def _within(matrix: NeighborMatrix, batch: Batch, cutoff: float | torch.Tensor) -> NeighborMatrix:
    """``matrix`` without the slots at or beyond ``cutoff`` (one, or one per system) now, the
    rest in their order."""
    with torch.no_grad():
        if isinstance(cutoff, torch.Tensor):
            cutoff = cutoff[batch.batch].unsqueeze(1)
        pos, cell = batch.positions.detach(), batch.cell.detach().to(batch.positions.dtype)
        shift = torch.einsum("nmi,nij->nmj", matrix.unit_shifts, cell[batch.batch])
        # the matrix's sign: the neighbour sits at x_j + s @ cell
        lengths = torch.linalg.vector_norm(pos[matrix.index] + shift - pos.unsqueeze(1), dim=-1)
        keep = ~matrix.pad & (lengths < cutoff)
        width = max(int(keep.sum(1).max()) if keep.numel() else 0, 1)
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]
        pad = ~keep.gather(1, order)
        rows = torch.arange(matrix.index.shape[0], device=pos.device).unsqueeze(1)
        index = torch.where(pad, rows, matrix.index.gather(1, order))
        shifts = matrix.unit_shifts.gather(1, order.unsqueeze(-1).expand(-1, -1, 3)) * (~pad).unsqueeze(-1)
        return NeighborMatrix(index, shifts, pad)
