"""The neighbour list a wrapper builds for itself at one process, with aimnet's own kernel.

When a batch comes without a list (a direct ``model(batch)`` call, as aimnet's calculator
is called), the wrapper needs one as deep as its Coulomb cutoff: two million pairs for
2000 atoms at 15 A. mlipdd's general builder (vesin, then one sort of every edge) took
0.7-0.9 s there; nvalchemiops' cell list, which aimnet's calculator uses, takes 0.3 s
and returns the pairs already grouped by receiver. Its receiver-major matrix is turned
into mlipdd's COO list (sorted by receiver, mlipdd's shift sign), so everything after
it is the code path every other list takes. Lists from the core (DD, dynamics with a
skin) are used as they come.

Open systems (no periodic axis anywhere in the batch: molecules, batches of molecules)
take the kernel's all-pairs search per system in one call over the whole batch, as
aimnet's calculator does; mlipdd's general builder loops over systems (208 molecules:
0.134 s on an H200 against aimnet's 0.018 s).
"""

from __future__ import annotations

import torch
from mlipdd.data import Batch
from mlipdd.neighbors import NeighborList


def _is_open(batch: Batch) -> bool:
    return not bool(batch.pbc.to(torch.bool).any())


def invertible_cells(batch: Batch) -> bool:
    """Every cell of ``batch`` can be inverted (one read of the device)."""
    return not bool((torch.linalg.det(batch.cell.detach().to(batch.positions.dtype)).abs() < 1e-9).any())


def _wrapped(batch: Batch, open_batch: bool, invertible: bool | None = None):
    """(positions inside their cell, integer images) with positions = wrapped + image @ cell,
    or None for a cell that cannot be inverted (the wrap needs fractional coordinates) in a
    batch with a periodic system. Open batches stay where they are (images zero).
    ``invertible``: `invertible_cells` of the batch, if known."""
    positions, cell = batch.positions.detach(), batch.cell.detach().to(batch.positions.dtype)
    if type(positions) is not torch.Tensor:
        return None
    if open_batch:
        return positions, torch.zeros_like(positions)
    if not (invertible_cells(batch) if invertible is None else invertible):
        return None
    system = batch.batch
    image = torch.floor(torch.einsum("ni,nij->nj", positions, torch.linalg.inv(cell)[system]))
    image = image * batch.pbc.to(torch.bool)[system].to(image.dtype)
    return positions - torch.einsum("ni,nij->nj", image, cell[system]), image


def _kernel_matrix(batch: Batch, wrapped, cutoff: float, lists: dict, largest: int | None):
    """(matrix, counts, shifts) of aimnet's `AdaptiveNeighborList` (one per cutoff: it
    remembers its width between calls), on positions inside the cell. ``largest``: the atoms
    of the largest system of an open batch (None: a batch with a periodic system)."""
    from aimnet.calculators.neighbors import AdaptiveNeighborList

    if cutoff not in lists:
        lists[cutoff] = AdaptiveNeighborList(cutoff=cutoff)
    nblist = lists[cutoff]
    system = batch.batch.to(torch.int32)
    if largest is not None:
        # no atom lists more than its own system's other atoms: the kernel's first guess from
        # the density (53,000 slots at 40 A) would allocate gigabytes for small molecules
        nblist.max_neighbors = min(nblist.max_neighbors, nblist._round_to_16(max(largest, 16)))
        matrix, counts, _ = nblist(wrapped, None, None, system, fill_value=wrapped.shape[0])
        # in the positions' dtype: the matrices' shifts are, so no cast follows (one launch less)
        return matrix, counts, torch.zeros((*matrix.shape, 3), dtype=wrapped.dtype, device=matrix.device)
    cell = batch.cell.detach().to(wrapped.dtype)
    return nblist(wrapped, cell, batch.pbc.to(torch.bool), system, fill_value=wrapped.shape[0])


def largest_system(batch: Batch) -> int:
    """The atoms of the batch's largest system (one read of the device)."""
    return int(torch.bincount(batch.batch).max()) if batch.num_atoms else 1


def aimnet_kernel_matrices(batch: Batch, cutoffs: dict[str, float], lists: dict, open_batch: bool | None = None,
                           largest: int | None = None, invertible: bool | None = None):
    """(matrices, images): aimnet's matrices straight from the kernel, one per ``{suffix:
    cutoff}`` (index, unit shifts, pad; padded slots point at the row itself), with no COO
    list in between, and each atom's image: the shifts hold for the positions moved into
    their cell, ``positions - images @ cell`` (as aimnet's calculator moves them; None for an
    open batch, which stays where it is). None
    where the kernel does not apply (see `_wrapped`). ``open_batch``: no system periodic (None:
    read from ``batch.pbc``). ``largest``: `largest_system` of an open batch, if known;
    ``invertible``: `invertible_cells`, if known."""
    from mlipdd_aimnet2.inputs import NeighborMatrix

    open_batch = _is_open(batch) if open_batch is None else open_batch
    found = _wrapped(batch, open_batch, invertible)
    if found is None:
        return None
    wrapped, image = found
    rows = torch.arange(wrapped.shape[0], device=wrapped.device).unsqueeze(1)
    if not open_batch:
        largest = None
    elif largest is None:
        largest = largest_system(batch)  # once for both cutoffs (a read of the device)
    matrices = {}
    for suffix, cutoff in cutoffs.items():
        matrix, counts, shifts = _kernel_matrix(batch, wrapped, cutoff, lists, largest)
        pad = torch.arange(matrix.shape[1], device=matrix.device).unsqueeze(0) >= counts.unsqueeze(1)
        index = torch.where(pad, rows, matrix.to(torch.long))
        matrices[suffix] = NeighborMatrix(index, shifts.to(wrapped.dtype), pad)
    # an open batch is not moved (images zero): no shift for the inputs to subtract
    return matrices, (None if open_batch else image)


def aimnet_kernel_neighbors(batch: Batch, cutoff: float, lists: dict,
                            open_batch: bool | None = None) -> NeighborList | None:
    """All pairs within ``cutoff`` through nvalchemiops as mlipdd's COO list (sorted by
    receiver, mlipdd's shift sign), or None where the kernel does not apply."""
    open_batch = _is_open(batch) if open_batch is None else open_batch
    found = _wrapped(batch, open_batch)
    if found is None:
        return None
    wrapped, image = found
    n = wrapped.shape[0]
    matrix, counts, shifts = _kernel_matrix(batch, wrapped, cutoff, lists, largest_system(batch) if open_batch else None)
    slots = torch.arange(matrix.shape[1], device=matrix.device).unsqueeze(0) < counts.unsqueeze(1)
    receiver = torch.arange(n, device=matrix.device).unsqueeze(1).expand_as(matrix)[slots]
    sender = matrix[slots].to(torch.long)
    # kernel: x_j + s @ cell - x_i on wrapped positions; mlipdd's edge vector is
    # x[receiver] + u @ cell - x[sender] on the batch's positions, so u = -(s - image_j + image_i)
    unit = -(shifts[slots].to(wrapped.dtype) - image[sender] + image[receiver])
    edge_index = torch.stack([sender, receiver.to(torch.long)])
    return NeighborList(edge_index, unit, float(cutoff), True)
