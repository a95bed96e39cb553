"""A small charge-equilibration potential in plain torch (AIMNet2-like in spirit).

Per atom, after one message-passing layer, the model predicts an electronegativity
``chi_i`` and a hardness ``J_i > 0``. Charges minimise ``sum_i chi_i q_i + J_i q_i^2 / 2``
under the constraint that each system's charges add up to its total charge ``Q``:

    q_i = (lam - chi_i) / J_i,   lam = (Q + sum_i chi_i / J_i) / sum_i 1 / J_i

so every forward holds per-system sums over all atoms of a system (``mol_sum``) in
the middle of the network, not only at the end. A second layer then passes messages
weighted by the neighbours' charges and adds a damped, smoothly truncated Coulomb-like
pair energy ``q_i q_j erf(r / a) / r`` within the cutoff. Forces and stress come from
autograd through everything, charges included.

No distributed code: under sharded storage the sums become local sum + all_reduce, the
reads of neighbours' rows are routed to their owners, and the multiplier ``lam`` read
per atom carries its gradient back to every rank (NOTE [aten sharded storage] in `mlipdd.shard.aten.index_rules`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mlipdd.data import Batch
from mlipdd.models.base import (
    ModelConfig,
    ModelWrapper,
    NeighborConfig,
    energy_forces_stress,
    per_system_sum,
)
from mlipdd.spec.kinds import OutputKind
from mlipdd.spec.presets import SPEC_MPNN_SHARDED
from mlipdd.testing.toy_models import species_rows, species_table

COULOMB = 14.399645  # e^2 / (4 pi eps0) in eV * Angstrom


def smooth_cutoff(d: torch.Tensor, cutoff: float) -> torch.Tensor:
    """1 at d=0, smoothly 0 at and beyond the cutoff (value and slope)."""
    return torch.where(d < cutoff, 0.5 * (torch.cos(math.pi * d / cutoff) + 1.0), torch.zeros_like(d))


class QEqModel(ModelWrapper):
    """Charge equilibration between two message-passing layers; outputs include ``charges``."""

    def __init__(self, cutoff: float = 5.0, features: int = 12, n_basis: int = 8, species=(1, 8),
                 damping: float = 1.5, coulomb_scale: float = 0.1, seed: int = 0, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.model_config = ModelConfig(
            NeighborConfig(cutoff),
            outputs=frozenset({"energy", "forces", "stress", "charges"}),
        )
        self.register_buffer("species_index", species_table(species))
        self.register_buffer("centers", torch.linspace(0.5, cutoff, n_basis, dtype=dtype))
        self.damping = float(damping)
        self.coulomb_scale = float(coulomb_scale)

        def param(*shape, scale=1.0):
            return nn.Parameter(torch.randn(*shape, generator=g, dtype=dtype) * scale)

        self.embed = param(len(species), features, scale=0.5)
        self.radial1 = param(n_basis, features, scale=1.0 / n_basis)
        self.update1 = param(features, features, scale=1.0 / features)
        self.chi_head = param(features, scale=1.0 / features)
        self.hardness_head = param(features, scale=1.0 / features)
        self.radial2 = param(n_basis, features, scale=1.0 / n_basis)
        self.update2 = param(features, features, scale=1.0 / features)
        self.readout = param(features, scale=1.0 / features)
        self.last_charges: torch.Tensor | None = None

    def distribution_spec(self, strategy=None):
        return SPEC_MPNN_SHARDED.replace(
            output_kinds={**SPEC_MPNN_SHARDED.output_kinds, "charges": OutputKind.PER_NODE},
            name="qeq_sharded",
        )

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        out = energy_forces_stress(self, batch, compute_stress, sum_systems=self.system_sum)
        out["charges"] = self.last_charges.detach()
        return out

    def system_sum(self, values: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The per-system sums of the charge equilibration (a subclass may route them elsewhere:
        tests/test_compile_ranks.py)."""
        return per_system_sum(values, batch)

    def atomic_energies(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        nl = batch.neighbors
        sender, receiver = nl.edge_index
        vectors = positions[receiver] + nl.shifts(cell, batch.batch) - positions[sender]
        d = vectors.norm(dim=1)
        envelope = smooth_cutoff(d, self.cutoff)  # edges past the cutoff (skin) add nothing
        basis = torch.exp(-2.0 * (d.unsqueeze(1) - self.centers) ** 2) * envelope.unsqueeze(1)

        # layer 1: environment -> electronegativity and hardness
        h = self.embed[species_rows(self, batch.atomic_numbers)]
        agg = torch.zeros_like(h)
        agg = agg.index_add(0, receiver, (basis @ self.radial1) * h[sender])
        h = h + torch.tanh(agg @ self.update1)
        chi = h @ self.chi_head
        hardness = nn.functional.softplus(h @ self.hardness_head) + 1.0

        # charge equilibration: one multiplier per system from two per-system sums
        total_charge = batch.charge
        if total_charge is None:  # neutral by default
            total_charge = torch.zeros(batch.num_systems, dtype=positions.dtype, device=positions.device)
        inverse_sum = self.system_sum(1.0 / hardness, batch)
        weighted_sum = self.system_sum(chi / hardness, batch)
        lam = (total_charge.reshape(-1) + weighted_sum) / inverse_sum
        q = (lam[batch.batch] - chi) / hardness
        self.last_charges = q

        # layer 2: messages weighted by the neighbours' charges, and a damped pair term
        q_sender, q_receiver = q[sender], q[receiver]
        agg2 = torch.zeros_like(h)
        agg2 = agg2.index_add(0, receiver, (basis @ self.radial2) * h[sender] * q_sender.unsqueeze(1))
        h = h + torch.tanh(agg2 @ self.update2)
        safe_d = torch.where(envelope > 0, d, torch.ones_like(d))
        pair = torch.erf(safe_d / self.damping) / safe_d * envelope
        coulomb = torch.zeros_like(q)
        coulomb = coulomb.index_add(0, receiver, 0.5 * self.coulomb_scale * COULOMB * q_receiver * q_sender * pair)
        return h @ self.readout + chi * q + 0.5 * hardness * q * q + coulomb

