"""mlipdd `Batch` -> the input mapping fairchem's UMA backbone and heads read.

fairchem's `AtomicData` validates itself as one complete batch (its atom count must
equal ``natoms.sum()``, every system must have an atom on this process). Under domain
decomposition neither holds: a rank holds ``[owned | ghost]`` rows while ``natoms``
must still be the true per-system count (charge/spin channel balancing and ``mean``
heads divide by it), and a rank may hold no atom of some system. So the backbone gets
`UMAInputs`, a dict with the small part of the `AtomicData` interface it uses
(item and attribute access, ``get(key, default=None)``, ``len`` = systems).
"""

from __future__ import annotations

import torch
from mlipdd.data import Batch


class UMAInputs(dict):
    """A dict that also answers ``data.key`` and ``data.get(key, default=None)``."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value

    def get(self, key, default=None):  # AtomicData.get passes default by keyword
        return super().get(key, default)

    def __len__(self) -> int:  # AtomicData's len is its number of systems
        return int(self["natoms"].shape[0])


def count_atoms(batch: Batch) -> torch.Tensor:
    """Atoms per system as an out-of-place ``index_add`` over atom rows.

    Written this way on purpose: single-process it is a bincount, and under halo
    decomposition the ShardTensor dispatch turns it into "owned rows + all_reduce", so
    every rank sees the true global counts without knowing it is distributed.
    """
    ones = torch.ones_like(batch.atomic_numbers, dtype=torch.long)
    counts = torch.zeros(batch.num_systems, dtype=torch.long, device=batch.device)
    return counts.index_add(0, batch.batch, ones)


def system_values(batch: Batch, name: str, default: int) -> torch.Tensor:
    """Integer charge / spin per system: the batch's own, else ``default`` everywhere."""
    value = getattr(batch, name)
    if value is None:
        return torch.full((batch.num_systems,), int(default), dtype=torch.long, device=batch.device)
    value = torch.as_tensor(value, device=batch.device).reshape(-1)
    if value.is_floating_point():
        rounded = value.round()
        if not torch.equal(rounded, value):
            raise ValueError(
                f"batch.{name} = {value.tolist()} is not integral; UMA takes the total {name} of each "
                f"system as an integer (charge in e, spin as multiplicity 2S+1): round it"
            )
        value = rounded
    return value.long()


def wrap_into_cell(positions: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor,
                   system: torch.Tensor) -> torch.Tensor:
    """Positions moved into the cell along periodic axes (fairchem's graph assumes it).

    The shift is a detached constant, so forces (d E / d positions) are unchanged.
    """
    if not bool(pbc.any()):
        return positions
    cell_per_atom = cell.detach()[system]
    frac = torch.linalg.solve(cell_per_atom.transpose(1, 2), positions.detach().unsqueeze(-1)).squeeze(-1)
    jump = torch.where(pbc[system], torch.floor(frac), torch.zeros_like(frac))
    if not bool((jump != 0).any()):
        return positions
    return positions - torch.einsum("ni,nij->nj", jump, cell_per_atom)


def uma_inputs(batch: Batch, task: str, charge: int, spin: int, positions: torch.Tensor,
               cell: torch.Tensor) -> UMAInputs:
    """The mapping `HydraModel.forward` reads, for ``task`` (UMA's dataset name)."""
    n_atoms, n_systems = positions.shape[0], batch.num_systems
    device = positions.device
    long = {"dtype": torch.long, "device": device}
    return UMAInputs(
        pos=positions,
        atomic_numbers=batch.atomic_numbers.long(),
        cell=cell,
        pbc=batch.pbc.bool().reshape(n_systems, 3),
        natoms=count_atoms(batch),
        batch=batch.batch,
        charge=system_values(batch, "charge", charge),
        spin=system_values(batch, "spin", spin),
        dataset=[task] * n_systems,
        edge_index=torch.empty((2, 0), **long),
        cell_offsets=torch.empty((0, 3), dtype=positions.dtype, device=device),
        nedges=torch.zeros(n_systems, **long),
        fixed=torch.zeros(n_atoms, **long),
        tags=torch.zeros(n_atoms, **long),
        sid=[""] * n_systems,
    )
