"""Small plain-torch models for tests, examples and validation demos.

`ToyMPNN` is a real multi-layer message-passing potential with autograd forces
(smooth cutoff, radial basis, residual node updates), written like any single-process
model: no distributed code anywhere.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mlipdd.data import Batch, InputError
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig, capturing
from mlipdd.neighbors import build_neighbor_list


def cosine_envelope(d: torch.Tensor, cutoff: float) -> torch.Tensor:
    """1 at d=0, smoothly 0 at and beyond the cutoff (value and slope)."""
    inside = d < cutoff
    return torch.where(inside, 0.5 * (torch.cos(math.pi * d / cutoff) + 1.0), torch.zeros_like(d))


def species_table(species) -> torch.Tensor:
    """The row of each atomic number in a per-species parameter table (-1: not modelled)."""
    table = torch.full((119,), -1, dtype=torch.long)
    table[torch.tensor(species)] = torch.arange(len(species))
    return table


def species_rows(model: nn.Module, atomic_numbers: torch.Tensor) -> torch.Tensor:
    """Each atom's row in ``model.species_index``; an element it has no parameters for is
    refused by name (checked eagerly, not while compiled or captured: a host read)."""
    index = model.species_index[atomic_numbers]
    if not capturing(index) and bool((index < 0).any()):
        unknown = sorted(set(atomic_numbers[index < 0].tolist()))
        raise InputError(f"{type(model).__name__} has no parameters for atomic numbers {unknown}; "
                         "build it with species=(...) that include them")
    return index


class ToyMPNN(ModelWrapper):
    def __init__(self, cutoff: float = 4.0, features: int = 16, layers: int = 3, n_basis: int = 8,
                 species=(1, 6, 8, 14, 18), seed: int = 0, dtype=torch.float64, drop_rebind: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.model_config = ModelConfig(NeighborConfig(cutoff))
        self.register_buffer("species_index", species_table(species))
        self.embed = nn.Parameter(torch.randn(len(species), features, generator=g, dtype=dtype) * 0.5)
        self.register_buffer("centers", torch.linspace(0.5, cutoff, n_basis, dtype=dtype))
        self.radial = nn.ParameterList(
            [nn.Parameter(torch.randn(n_basis, features, generator=g, dtype=dtype) / n_basis) for _ in range(layers)]
        )
        self.update = nn.ParameterList(
            [nn.Parameter(torch.randn(features, features, generator=g, dtype=dtype) / features) for _ in range(layers)]
        )
        self.readout = nn.Parameter(torch.randn(features, generator=g, dtype=dtype) / features)
        self.drop_rebind = drop_rebind  # reproduces the classic mistake, for validator tests

    @property
    def message_passing_layers(self) -> int:
        """Neighbour hops an atom's energy reads, one per layer (sets the ghost shell of a
        compiled run at several ranks: mlipdd.distributed.compiled_halo)."""
        return len(self.radial)

    def atomic_energies(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        nl = batch.neighbors if batch.neighbors is not None else build_neighbor_list(batch, self.cutoff)
        sender, receiver = nl.edge_index
        vectors = positions[receiver] + nl.shifts(cell, batch.batch) - positions[sender]
        d = vectors.norm(dim=1)
        envelope = cosine_envelope(d, self.cutoff)
        basis = torch.exp(-2.0 * (d.unsqueeze(1) - self.centers) ** 2) * envelope.unsqueeze(1)
        h = self.embed[species_rows(self, batch.atomic_numbers)]
        for radial, update in zip(self.radial, self.update):
            messages = (basis @ radial) * h[sender]
            agg = torch.zeros_like(h)
            if self.drop_rebind:
                agg.index_add_(0, receiver, messages)
            else:
                agg = agg.index_add_(0, receiver, messages)
            h = h + torch.tanh(agg @ update)
        return h @ self.readout
