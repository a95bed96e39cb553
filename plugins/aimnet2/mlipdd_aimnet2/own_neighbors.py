"""The neighbour list a wrapper builds for itself at one process, with aimnet's own kernel.

When a batch comes without a list (a direct ``model(batch)`` call, as aimnet's calculator
is called), the wrapper needs one as deep as its Coulomb cutoff: two million pairs for
2000 atoms at 15 A. mlipdd's general builder (vesin, then one sort of every edge) took
0.7-0.9 s there; nvalchemiops' cell list, which aimnet's calculator uses, takes 0.3 s
and returns the pairs already grouped by receiver. Its receiver-major matrix is turned
into mlipdd's COO list (sorted by receiver, mlipdd's shift sign), so everything after
it is the code path every other list takes. Lists from the core (DD, dynamics with a
skin) are used as they come.
"""

from __future__ import annotations

import torch
from mlipdd.data import Batch
from mlipdd.neighbors import NeighborList


def aimnet_kernel_neighbors(batch: Batch, cutoff: float, lists: dict) -> NeighborList | None:
    """All pairs within ``cutoff`` through nvalchemiops, or None where it does not apply.

    ``lists`` keeps aimnet's `AdaptiveNeighborList` per cutoff (it remembers the matrix
    width between calls). None (fall back to mlipdd's builder) for a cell that cannot be
    inverted: the wrap into the cell needs fractional coordinates.
    """
    from aimnet.calculators.neighbors import AdaptiveNeighborList

    positions, cell = batch.positions.detach(), batch.cell.detach().to(batch.positions.dtype)
    if type(positions) is not torch.Tensor or bool((torch.linalg.det(cell).abs() < 1e-9).any()):
        return None
    pbc = batch.pbc.to(torch.bool)
    system = batch.batch
    # the kernel expects atoms inside their cell (aimnet's calculator wraps them first);
    # positions = wrapped + image @ cell, so a pair's shift changes by the two images
    image = torch.floor(torch.einsum("ni,nij->nj", positions, torch.linalg.inv(cell)[system]))
    image = image * pbc[system].to(image.dtype)
    wrapped = positions - torch.einsum("ni,nij->nj", image, cell[system])
    if cutoff not in lists:
        lists[cutoff] = AdaptiveNeighborList(cutoff=cutoff)
    n = positions.shape[0]
    matrix, counts, shifts = lists[cutoff](wrapped, cell, pbc, system.to(torch.int32), fill_value=n)
    slots = torch.arange(matrix.shape[1], device=matrix.device).unsqueeze(0) < counts.unsqueeze(1)
    receiver = torch.arange(n, device=matrix.device).unsqueeze(1).expand_as(matrix)[slots]
    sender = matrix[slots].to(torch.long)
    # kernel: x_j + s @ cell - x_i on wrapped positions; mlipdd's edge vector is
    # x[receiver] + u @ cell - x[sender] on the batch's positions, so u = -(s - image_j + image_i)
    unit = -(shifts[slots].to(positions.dtype) - image[sender] + image[receiver])
    edge_index = torch.stack([sender, receiver.to(torch.long)])
    return NeighborList(edge_index, unit, float(cutoff), True)
