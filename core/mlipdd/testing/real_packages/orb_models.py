"""orb-models' orb-v3 (conservative and direct), built from its own architecture functions.

`orb_v3_conservative_architecture` / `orb_v3_direct_architecture` are what orb's pretrained
loaders call before loading weights (`orb_models.forcefield.pretrained`); here they build
a small model (latent 32, two message-passing steps) with random weights from a seeded
torch RNG (the same on every rank), in float64 as ``load_model(precision="float64")``
sets it. orb's ZBL pair repulsion, its energy head (an MLP of the per-system mean node
feature, times the atom count), its attention gates (messages to receivers AND senders)
and its rotation/strain generators all run as orb wrote them.

The input is orb's `AtomGraphs`, filled from the batch the way
`ase_atoms_to_atom_graphs` fills it from an ASE structure: orb's own neighbour search
runs on numpy copies of one structure and never sees a distributed batch, so the graph
is the batch's list (orb's ``senders``/``receivers`` are our sender/receiver, its
``unit_shifts`` ours: ``vectors = pos[receivers] - pos[senders] + unit_shifts @ cell``).
orb caps each atom's neighbours (20 or 120 nearest, the "-20"/"-inf" models); the
systems here have fewer than 120 within the cutoff, so the "-inf" graph is every pair.
"""

from __future__ import annotations

import torch

from mlipdd.data import Batch
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.testing.real_packages.building import seeded_build

CUTOFF = 6.0  # orb-v3's radius (its Bessel basis and attention envelope both end at 6 A)
MAX_NEIGHBORS = 120  # orb-v3 "-inf"
SMALL = {"latent_dim": 32, "base_mlp_hidden_dim": 64, "base_mlp_depth": 2, "head_mlp_hidden_dim": 32,
         "head_mlp_depth": 1, "num_message_passing_steps": 2}


def _voigt_to_3x3(voigt: torch.Tensor) -> torch.Tensor:
    """orb's (n, 6) ``[xx, yy, zz, yz, xz, xy]`` back to (n, 3, 3)."""
    xx, yy, zz, yz, xz, xy = voigt.unbind(-1)
    return torch.stack([torch.stack([xx, xy, xz], -1), torch.stack([xy, yy, yz], -1),
                        torch.stack([xz, yz, zz], -1)], -2)


class OrbPotential(ModelWrapper):
    """energy, forces and stress of an orb-v3 model (``kind``: ``"conservative"``: forces and
    stress by autograd inside orb; ``"direct"``: orb's force and stress heads)."""

    def __init__(self, kind: str = "conservative", seed: int = 0, dtype=torch.float64):
        super().__init__()
        from orb_models.forcefield import pretrained
        from orb_models.forcefield.atomic_system import SystemConfig

        self.kind = kind
        direct = kind == "direct"
        self.model_config = ModelConfig(NeighborConfig(CUTOFF), extra={"atomic_numbers": (1, 8)},
                                        autograd_outputs=frozenset() if direct else frozenset({"forces", "stress"}))
        build = pretrained.orb_v3_direct_architecture if direct else pretrained.orb_v3_conservative_architecture
        with seeded_build(seed):
            self.model = build(**SMALL, device="cpu",
                               system_config=SystemConfig(radius=CUTOFF, max_num_neighbors=MAX_NEIGHBORS))
        self.model = self.model.to(dtype).eval()
        self.dtype = dtype

    def adapt_input(self, batch: Batch):
        from orb_models.forcefield.base import AtomGraphs

        sender, receiver = batch.neighbors.edge_index
        numbers = batch.atomic_numbers.long()
        return AtomGraphs(
            senders=sender,
            receivers=receiver,
            n_node=torch.bincount(batch.batch, minlength=batch.num_systems),
            n_edge=torch.bincount(batch.neighbors.edge_system(batch.batch), minlength=batch.num_systems),
            node_features={
                "positions": batch.positions,
                "atomic_numbers": numbers,
                "atomic_numbers_embedding": torch.nn.functional.one_hot(numbers, num_classes=118).to(self.dtype),
            },
            # "vectors": what orb's graph construction stores (a direct model reads it; a
            # conservative one recomputes it from positions, unit_shifts and cell)
            edge_features={"vectors": batch.neighbors.edge_vectors(batch.positions, batch.cell, batch.batch),
                           "unit_shifts": batch.neighbors.unit_shifts.to(self.dtype)},
            system_features={"cell": batch.cell, "pbc": batch.pbc},
            node_targets=None, edge_targets=None, system_targets=None, system_id=None, fix_atoms=None, tags=None,
            radius=CUTOFF,
            max_num_neighbors=torch.tensor([MAX_NEIGHBORS]),
        )

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        if batch.neighbors is None:
            from mlipdd.neighbors import attach_neighbors

            attach_neighbors(batch, self.cutoff)
        graphs = self.adapt_input(batch)
        positions = graphs.node_features["positions"]
        restore_flag = positions.is_leaf and not positions.requires_grad  # orb sets it in place
        try:
            with torch.enable_grad():
                out = self.model.predict(graphs)
        finally:
            if restore_flag:
                positions.requires_grad_(False)
        if self.kind == "direct":
            result = {"energy": out["energy"], "forces": out["forces"]}
            stress = out.get("stress")
        else:
            result = {"energy": out["energy"], "forces": out[self.model.grad_forces_name]}
            stress = out[self.model.grad_stress_name]
        if compute_stress:
            result["stress"] = _voigt_to_3x3(stress.view(-1, 6))
        return result


def conservative(seed: int = 0) -> OrbPotential:
    return OrbPotential("conservative", seed=seed)


def direct(seed: int = 0) -> OrbPotential:
    return OrbPotential("direct", seed=seed)
