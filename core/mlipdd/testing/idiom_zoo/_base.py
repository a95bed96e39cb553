"""What every zoo model shares: an element table, a radial basis, one plain interaction.

Each zoo model is a small potential written the way a single-process MLIP is written:
it embeds the atomic numbers, runs a message-passing layer, applies ITS idiom, then
runs a second layer that reads the idiom's result from the neighbours (so a wrong
ghost row, or a wrong value on one rank, reaches the energy of other atoms), and
reads out one energy per atom. The shared pieces below are the parts every MLIP has
and that are not under test; the idiom lives in the model's own ``atomic_energies``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from mlipdd.data import Batch
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig


class Edges(NamedTuple):
    sender: torch.Tensor
    receiver: torch.Tensor
    vectors: torch.Tensor  # receiver image - sender, (E, 3)
    distance: torch.Tensor  # (E,)
    envelope: torch.Tensor  # smooth cutoff, 1 at 0, 0 (value and slope) at the cutoff
    rbf: torch.Tensor  # Gaussian basis times the envelope, (E, n_basis)


def cosine_cutoff(d: torch.Tensor, cutoff: float) -> torch.Tensor:
    return torch.where(d < cutoff, 0.5 * (torch.cos(math.pi * d / cutoff) + 1.0), torch.zeros_like(d))


def shifted_softplus(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.softplus(x) - math.log(2.0)


class ZooModel(ModelWrapper):
    """Base of the zoo: ``idiom`` is the one line the classification table shows."""

    idiom: str = ""

    def __init__(self, cutoff: float = 4.5, features: int = 8, n_basis: int = 8, layers: int = 2,
                 seed: int = 0, dtype=torch.float64):
        super().__init__()
        self.model_config = ModelConfig(NeighborConfig(cutoff))
        self.features, self.n_basis, self.dtype = features, n_basis, dtype
        self.generator = torch.Generator().manual_seed(seed)
        self.embed = self.weight(119, features, scale=0.5)  # one row per atomic number
        self.register_buffer("centers", torch.linspace(0.5, cutoff, n_basis, dtype=dtype))
        self.filters = nn.ParameterList([self.weight(n_basis, features) for _ in range(layers)])
        self.updates = nn.ParameterList([self.weight(features, features) for _ in range(layers)])
        self.readout = self.weight(features)

    def weight(self, *shape, scale: float | None = None) -> nn.Parameter:
        scale = 1.0 / math.sqrt(shape[0]) if scale is None else scale
        return nn.Parameter(torch.randn(*shape, generator=self.generator, dtype=self.dtype) * scale)

    def seeded(self, module: nn.Module) -> nn.Module:
        """``module`` in this model's dtype with parameters drawn from its generator (the
        same numbers in every process that builds the model)."""
        module = module.to(self.dtype)
        with torch.no_grad():
            for p in module.parameters():
                fan_in = p.shape[-1] if p.dim() > 1 else 4
                p.copy_(torch.randn(p.shape, generator=self.generator, dtype=self.dtype) / math.sqrt(fan_in))
        return module

    def edges(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor) -> Edges:
        nl = batch.neighbors
        sender, receiver = nl.edge_index
        vectors = positions[receiver] + nl.shifts(cell, batch.batch) - positions[sender]
        d = torch.linalg.norm(vectors, dim=-1)
        envelope = cosine_cutoff(d, self.cutoff)
        rbf = torch.exp(-2.0 * (d[:, None] - self.centers) ** 2) * envelope[:, None]
        return Edges(sender, receiver, vectors, d, envelope, rbf)

    def interaction(self, layer: int, h: torch.Tensor, e: Edges) -> torch.Tensor:
        """h + tanh(sum over the receiver's edges of filter(r) * h[sender] @ W)."""
        messages = (e.rbf @ self.filters[layer]) * h[e.sender]
        aggregated = torch.zeros_like(h).index_add(0, e.receiver, messages)
        return h + torch.tanh(aggregated @ self.updates[layer])

    def energy(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.readout


class TwoLayerZooModel(ZooModel):
    """embed -> layer 0 -> ``idiom(h, ...)`` -> layer 1 (reads the idiom's rows by sender) -> energy."""

    def idiom_step(self, h: torch.Tensor, e: Edges, batch: Batch, positions: torch.Tensor,
                   cell: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def atomic_energies(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        e = self.edges(batch, positions, cell)
        h = self.embed[batch.atomic_numbers]
        h = self.interaction(0, h, e)
        h = self.idiom_step(h, e, batch, positions, cell)
        h = self.interaction(1, h, e)
        return self.energy(h)
