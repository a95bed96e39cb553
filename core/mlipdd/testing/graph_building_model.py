"""A plain-torch potential that builds its own graph inside forward (like UMA / eSCN).

`GraphBuildingMPNN` takes positions, cell and pbc, builds its radius graph with
`mlipdd.neighbors.build_neighbor_list`, runs a few message-passing layers, sums
per-atom energies and differentiates for forces and (by strain) stress. It never
reads ``batch.neighbors``, so a halo-padded view cannot be handed to it: it runs
under the graph-partition strategy instead.

It is ordinary single-process code. The five calls into
`mlipdd.shard.graph_partition` mark where a node partition matters; each is the
identity when no partition is active, so one process runs it as a plain model:

* ``keep_owned_receivers`` after the graph build (each edge on its receiver's owner);
* ``owned_rows`` for per-atom inputs (atomic numbers, system index);
* ``gather_nodes`` once per layer before reading sender features;
* ``local_receivers`` to scatter messages into the owned rows;
* ``sum_over_ranks`` for the per-system energy.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mlipdd.data import Batch
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig, strained
from mlipdd.neighbors import build_neighbor_list
from mlipdd.shard import graph_partition as gp
from mlipdd.testing.toy_models import species_rows, species_table


def _envelope(d: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Smoothly 1 -> 0 at the cutoff (value and slope), so energies are continuous."""
    return torch.where(d < cutoff, 0.5 * (torch.cos(math.pi * d / cutoff) + 1.0), torch.zeros_like(d))


class GraphBuildingMPNN(ModelWrapper):
    """Radius graph built in forward, ``layers`` message-passing layers, autograd forces."""

    def __init__(self, cutoff: float = 4.5, features: int = 16, layers: int = 3, n_basis: int = 8,
                 species=(1, 6, 8, 14, 18), seed: int = 0, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.model_config = ModelConfig(NeighborConfig(cutoff))
        self.register_buffer("species_index", species_table(species))
        self.embed = nn.Parameter(torch.randn(len(species), features, generator=g, dtype=dtype) * 0.5)
        self.register_buffer("centers", torch.linspace(0.5, cutoff, n_basis, dtype=dtype))

        def weights(*shape, scale):
            return nn.Parameter(torch.randn(*shape, generator=g, dtype=dtype) * scale)

        self.radial = nn.ParameterList([weights(n_basis, features, scale=1 / n_basis) for _ in range(layers)])
        # the receiver's own state gates its incoming messages: every layer reads both ends
        self.gate = nn.ParameterList([weights(features, features, scale=1 / features) for _ in range(layers)])
        self.update = nn.ParameterList([weights(features, features, scale=1 / features) for _ in range(layers)])
        self.readout = weights(features, scale=1 / features)

    def distribution_spec(self, strategy=None):
        # Only graph partition fits a model that builds its own graph; asked for another
        # strategy, DistributedModel then refuses with a message naming the mismatch.
        from mlipdd.spec.presets import SPEC_MPNN_GP

        return SPEC_MPNN_GP

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        index = species_rows(self, batch.atomic_numbers)  # full rows: every rank checks alike
        grad_enabled = torch.is_grad_enabled()
        with torch.enable_grad():
            positions = batch.positions.detach().requires_grad_(True)
            inputs, cell = [positions], batch.cell
            if compute_stress:
                strain = torch.zeros_like(batch.cell, requires_grad=True)
                inputs.append(strain)
                view = Batch._from_dicts({**batch.node, "positions": positions}, dict(batch.system))
                positions_used, cell = strained(view, strain)
            else:
                positions_used = positions
            energies = self.owned_energies(batch, positions_used, cell, gp.owned_rows(index))
            system = gp.owned_rows(batch.batch)
            partial = energies.new_zeros(batch.num_systems).index_add(0, system, energies)
            energy = gp.sum_over_ranks(partial)
            grads = torch.autograd.grad(energy.sum(), inputs, create_graph=grad_enabled and
                                        getattr(self, "force_training", False))
        out = {"energy": energy, "energies": energies, "forces": -grads[0]}
        if compute_stress:
            out["stress"] = grads[1] / torch.linalg.det(batch.cell).abs().view(-1, 1, 1)
        return out

    def owned_energies(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor,
                       owned_species: torch.Tensor) -> torch.Tensor:
        """Per-atom energies of the owned atoms (all atoms in one process)."""
        geometry = Batch._from_dicts(
            {"positions": positions, "batch": batch.batch, "atom_ids": batch.atom_ids},
            {"cell": cell, "pbc": batch.pbc},
        )
        nl = build_neighbor_list(geometry, self.cutoff)  # on the full geometry, as UMA does
        edge_index, unit_shifts = gp.keep_owned_receivers(nl.edge_index, nl.unit_shifts)
        sender, receiver = edge_index
        edge_cell = cell.index_select(0, batch.batch.index_select(0, receiver))
        shifts = torch.einsum("ei,eij->ej", unit_shifts.to(cell.dtype), edge_cell)
        d = (positions[receiver] + shifts - positions[sender]).norm(dim=1)
        basis = torch.exp(-2.0 * (d.unsqueeze(1) - self.centers) ** 2) * _envelope(d, self.cutoff).unsqueeze(1)
        target = gp.local_receivers(receiver)
        h = self.embed[owned_species]
        for radial, gate, update in zip(self.radial, self.gate, self.update):
            h_all = gp.gather_nodes(h)  # sender rows may belong to other ranks
            messages = (basis @ radial) * h_all[sender] * torch.sigmoid(h[target] @ gate)
            agg = torch.zeros_like(h).index_add(0, target, messages)
            h = h + torch.tanh(agg @ update)
        return h @ self.readout
