"""schnetpack's SchNet and PaiNN, built the way its users build a potential.

A `NeuralNetworkPotential` with schnetpack's own input modules (`Strain`, then
`PairwiseDistances`), its representation, an `Atomwise` energy head and its `Forces`
response module (forces and stress by autograd, inside schnetpack). schnetpack's
neighbour lists are data transforms on numpy copies of one structure (ASE, matscipy),
which never see a distributed batch, so the inputs take the batch's edges in
schnetpack's convention: ``idx_i`` is the centre atom that sums the messages (our
receiver), ``idx_j`` its neighbour, ``Rij = R[idx_j] - R[idx_i] + offsets``.
Weights are random, drawn from a seeded torch RNG (the same on every rank).
"""

from __future__ import annotations

import torch

from mlipdd.data import Batch
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.testing.real_packages.building import seeded_build

FEATURES = 16
N_RBF = 12


def _import_schnetpack():
    """schnetpack 2.0.4 imports ``T_co`` from torch's dataloader module, which torch 2.13
    no longer defines (a typing variable only); define it as torch did, then import."""
    import typing

    from torch.utils.data import dataloader

    if not hasattr(dataloader, "T_co"):
        dataloader.T_co = typing.TypeVar("T_co", covariant=True)
    import schnetpack

    return schnetpack


def _representation(kind: str, cutoff: float):
    spk = _import_schnetpack()

    radial_basis = spk.nn.GaussianRBF(n_rbf=N_RBF, cutoff=cutoff)
    cutoff_fn = spk.nn.CosineCutoff(cutoff)
    if kind == "schnet":
        return spk.representation.SchNet(n_atom_basis=FEATURES, n_interactions=2, radial_basis=radial_basis,
                                         cutoff_fn=cutoff_fn)
    return spk.representation.PaiNN(n_atom_basis=FEATURES, n_interactions=2, radial_basis=radial_basis,
                                    cutoff_fn=cutoff_fn)


class SchnetpackPotential(ModelWrapper):
    """energy, forces and stress of a schnetpack `NeuralNetworkPotential` (``kind``:
    ``"schnet"`` or ``"painn"``)."""

    def __init__(self, kind: str = "schnet", cutoff: float = 4.5, seed: int = 0, dtype=torch.float64):
        super().__init__()
        spk = _import_schnetpack()

        self.model_config = ModelConfig(NeighborConfig(cutoff), extra={"atomic_numbers": (1, 8)})
        with seeded_build(seed):
            self.model = spk.model.NeuralNetworkPotential(
                representation=_representation(kind, cutoff),
                input_modules=[spk.atomistic.Strain(), spk.atomistic.PairwiseDistances()],
                output_modules=[spk.atomistic.Atomwise(n_in=FEATURES, output_key="energy"),
                                spk.atomistic.Forces(calc_forces=True, calc_stress=True)],
            ).to(dtype)
        self.dtype = dtype

    def adapt_input(self, batch: Batch) -> dict:
        properties = _import_schnetpack().properties

        sender, receiver = batch.neighbors.edge_index
        return {
            properties.Z: batch.atomic_numbers,
            properties.R: batch.positions,
            properties.cell: batch.cell,
            properties.pbc: batch.pbc,
            properties.idx_m: batch.batch,
            properties.n_atoms: torch.bincount(batch.batch, minlength=batch.num_systems),
            properties.idx_i: receiver,
            properties.idx_j: sender,
            properties.offsets: -batch.neighbors.shifts(batch.cell, batch.batch),
        }

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        if batch.neighbors is None:
            from mlipdd.neighbors import attach_neighbors

            attach_neighbors(batch, self.cutoff)
        inputs = self.adapt_input(batch)
        positions = inputs["_positions"]
        restore_flag = positions.is_leaf and not positions.requires_grad  # schnetpack sets it in place
        try:
            with torch.enable_grad():
                out = self.model(inputs)
        finally:
            if restore_flag:
                positions.requires_grad_(False)
        result = {"energy": out["energy"], "forces": out["forces"]}
        if compute_stress:
            result["stress"] = out["stress"]
        return result


def schnet(seed: int = 0) -> SchnetpackPotential:
    return SchnetpackPotential("schnet", seed=seed)


def painn(seed: int = 0) -> SchnetpackPotential:
    return SchnetpackPotential("painn", seed=seed)
