"""Translate an mlipdd `Batch` into the input dict a mace model's forward reads.

Single-process code. Under domain decomposition the positions are a tensor subclass
over ``[owned | ghost]`` rows and the neighbour list holds only edges with an owned
receiver; nothing here needs to know.
"""

from __future__ import annotations

import torch

from mlipdd.data import Batch, InputError
from mlipdd.models import capturing


def one_hot_elements(
    atomic_numbers: torch.Tensor, model_elements: torch.Tensor, dtype
) -> torch.Tensor:
    """mace's ``node_attrs``: one column per element of the model, in its order.

    Raises InputError naming elements the model was not trained on.
    """
    model_elements = model_elements.to(atomic_numbers.device)
    match = atomic_numbers.view(-1, 1) == model_elements.view(1, -1)
    known = match.any(dim=1)
    if not bool(known.all()):
        from ase.data import chemical_symbols

        unknown = sorted({int(z) for z in atomic_numbers[~known].tolist()})
        names = ", ".join(
            f"{chemical_symbols[z] if 0 < z < len(chemical_symbols) else '?'} (Z={z})"
            for z in unknown
        )
        model_names = " ".join(chemical_symbols[int(z)] for z in model_elements.tolist())
        raise InputError(
            f"the MACE model has no parameters for element(s) {names}; it knows only "
            f"{model_names}. Remove those atoms or use a model trained on them"
        )
    return match.to(dtype)


def neighbor_list_for(batch: Batch, cutoff: float):
    """``batch.neighbors`` when the caller built one (under DD: the core), else a fresh list."""
    if batch.neighbors is not None:
        return batch.neighbors
    from mlipdd.neighbors import build_neighbor_list  # lazy: core module may be optional

    return build_neighbor_list(batch, cutoff)


def edges_within_cutoff(
    positions: torch.Tensor,
    edge_index: torch.Tensor,
    unit_shifts: torch.Tensor,
    cell: torch.Tensor,
    system_of_atom: torch.Tensor,
    cutoff: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Edges shorter than ``cutoff`` and not a self-edge, with their integer shifts.

    Lists may carry a skin (rebuilt every few MD steps) or come from a larger model in a
    pipeline; mace's own lists stop at ``r_max``, so we drop the extra edges to do the
    same work. A zero-length self-edge (i == i, no shift) would give NaN directions.
    """
    # The mask is bookkeeping, not physics: no autograd. The reads go through the ordinary
    # indexing, so under domain decomposition they are served like the model's own: from
    # ghost rows (halo storage) or from the owners (sharded storage).
    with torch.no_grad():
        pos = positions.detach()
        sender, receiver = edge_index[0], edge_index[1]
        shifts = cartesian_shifts(unit_shifts, cell.detach(), system_of_atom[sender])
        vectors = pos[receiver] - pos[sender] + shifts
        length_sq = (vectors * vectors).sum(dim=1)
        keep = length_sq < cutoff * cutoff
        # only a zero-length edge can be a self-edge; asking which is which compares row
        # numbers, which the aten dispatch refuses (an own image is another row under DD),
        # so it is asked only of a list that has one (mlipdd's lists never do)
        zero = (length_sq == 0).any()
    if bool(zero):
        with torch.no_grad():
            keep = keep & ~((sender == receiver) & (unit_shifts == 0).all(dim=1))
    if bool(keep.all()):
        return edge_index, unit_shifts
    return edge_index[:, keep], unit_shifts[keep]


def cartesian_shifts(
    unit_shifts: torch.Tensor, cell: torch.Tensor, system_of_edge: torch.Tensor
) -> torch.Tensor:
    """Cartesian image shifts ``n @ cell`` of each edge's own system.

    One system (an MD run) takes one (E, 3) x (3, 3) product: the per-edge form below gathers
    a 3x3 cell per edge and runs as E/65535 batched matrix-vector launches on CUDA (3.9 ms of
    a 134 ms medium-MACE call at 64k atoms on an H200). Several systems: mace's strained-cell
    form, per edge.
    """
    cells = cell.view(-1, 3, 3)
    if cells.shape[0] == 1:
        return unit_shifts @ cells[0]
    return torch.einsum("be,bec->bc", unit_shifts, cells[system_of_edge])


# A list trimmed to the cutoff by the core (one rank, `DistributedModel`) says it reaches
# the cutoff plus a rounding margin of 1e-3 A; such edges past r_max weigh exactly zero.
_TRIMMED_MARGIN = 1e-3


def _built_within(neighbors, cutoff: float) -> bool:
    """A list built (by mlipdd's builder) or trimmed at no more than the model's radius has
    no edge to drop: not a self-edge, and an edge past ``r_max`` weighs exactly zero (mace
    multiplies every edge by its cutoff envelope, 0 beyond ``r_max``, and so its gradient).
    Skipping the filter saves its device->host reads (three) and a per-edge einsum per call."""
    built = getattr(neighbors, "cutoff", None)
    return built is not None and built <= cutoff + _TRIMMED_MARGIN


def _kept(cache: dict | None, name: str, tensor: torch.Tensor, extra, compute):
    """``compute()``, reused while ``tensor`` is the very same, unmodified tensor (one rank under
    DistributedModel, or an MD loop on one batch) and ``extra`` is unchanged: what it reads from
    the device then runs once rather than every call. ``cache`` None: computed every call."""
    if cache is None:
        return compute()
    key = (tensor._version, extra)
    held = cache.get(name)
    if held is not None and held[0] is tensor and held[1] == key:
        return held[2]
    value = compute()
    cache[name] = (tensor, key, value)
    return value


def _cached_one_hot(atomic_numbers, model_elements, dtype, cache: dict | None):
    """`one_hot_elements`, kept while the numbers are the same tensor (`_kept`): the element
    check reads the device.

    While a CUDA graph is captured (`mlipdd.models.capturing`) the table is computed inside
    the graph, unchecked (the warm-up calls checked these very numbers): a cached tensor
    could leave the cache while the graph still reads its memory."""
    if capturing(atomic_numbers):
        model_elements = model_elements.to(atomic_numbers.device)
        return (atomic_numbers.view(-1, 1) == model_elements.view(1, -1)).to(dtype)
    return _kept(cache, "one_hot", atomic_numbers, dtype,
                 lambda: one_hot_elements(atomic_numbers, model_elements, dtype))


def _cached_ptr(batch: Batch, cache: dict | None) -> torch.Tensor:
    """``batch.ptr`` (system boundaries), kept while the system index is the same tensor
    (`_kept`): on a GPU its bincount waits for the device. Plain tensors only: under domain
    decomposition every rank must take the same collectives, so nothing rank-local is cached."""
    system_of_atom = batch.batch
    if type(system_of_atom) is not torch.Tensor or capturing(system_of_atom):
        return batch.ptr
    return _kept(cache, "ptr", system_of_atom, batch.num_systems, lambda: batch.ptr)


def mace_inputs(
    batch: Batch, model_elements: torch.Tensor, cutoff: float, dtype: torch.dtype, head: int = 0,
    cache: dict | None = None,
) -> dict:
    """The dict a mace model's forward takes, built from ``batch``.

    ``positions`` is the batch's own tensor (same object) when its dtype already matches:
    mace differentiates the energy with respect to it, and under domain decomposition
    its identity is what routes ghost gradients back to owners.
    """
    positions = batch.positions
    if positions.dtype != dtype:
        positions = positions.to(dtype)
    cell = batch.cell.to(dtype)
    system_of_atom = batch.batch
    neighbors = neighbor_list_for(batch, cutoff)
    edge_index = neighbors.edge_index.to(device=positions.device, dtype=torch.long)
    unit_shifts = neighbors.unit_shifts.to(device=positions.device, dtype=dtype)
    # a CUDA graph's list (padded: fixed size, null edges in its unused slots) and anything
    # under a capture (no host reads then) keep every edge: those past r_max weigh zero
    if not (_built_within(neighbors, cutoff) or getattr(neighbors, "padded", False) or capturing(positions)):
        edge_index, unit_shifts = edges_within_cutoff(
            positions, edge_index, unit_shifts, cell, system_of_atom, cutoff
        )
    num_systems = batch.num_systems
    return {
        "positions": positions,
        "node_attrs": _cached_one_hot(batch.atomic_numbers, model_elements, dtype, cache),
        "edge_index": edge_index,
        "unit_shifts": unit_shifts,
        "shifts": cartesian_shifts(unit_shifts, cell, system_of_atom[edge_index[0]]),
        "cell": cell,
        "batch": system_of_atom,
        "ptr": _cached_ptr(batch, cache),
        "head": torch.full((num_systems,), head, dtype=torch.long, device=positions.device),
    }
