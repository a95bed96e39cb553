"""matgl's TensorNet under matgl's `Potential` (forces and stress by autograd inside matgl).

A `TensorNet` built from its own constructor (two species, a smaller width, two blocks)
with random weights from a seeded torch RNG (the same on every rank), in float64, inside
`matgl.apps.pes.Potential` as matgl's pretrained potentials and `PESCalculator` run it:
the Potential builds the strained lattice, cartesian positions from fractional
coordinates, the image shifts, and differentiates the energy for forces and stress.

The input is the PyG graph matgl's `Atoms2Graph` makes from one structure (matgl's own
neighbour search runs on numpy copies and never sees a distributed batch): fractional
coordinates, ``edge_index`` and integer ``pbc_offset``, filled from the batch. matgl's
``edge_index[0]`` is the centre atom that sums the messages (our receiver),
``edge_index[1]`` its neighbour, ``bond_vec = pos[edge_index[1]] + offset @ lattice - pos[edge_index[0]]``:
the batch's edge reversed. One structure per call, as `PESCalculator` does.
"""

from __future__ import annotations

import torch

from mlipdd.data import Batch
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.testing.real_packages.building import seeded_build

CUTOFF = 5.0  # TensorNet's default
ELEMENTS = ("H", "O")
SMALL = {"units": 16, "nblocks": 2, "num_rbf": 8}
EV_PER_ANG3_TO_GPA = 160.21766208  # matgl reports stress in GPa


class TensorNetPotential(ModelWrapper):
    """energy, forces and stress of a matgl `Potential(TensorNet)`."""

    def __init__(self, seed: int = 0, dtype=torch.float64):
        super().__init__()
        from ase.data import atomic_numbers
        from matgl.apps.pes import Potential
        from matgl.models import TensorNet

        self.model_config = ModelConfig(NeighborConfig(CUTOFF), extra={"atomic_numbers": (1, 8)})
        with seeded_build(seed):
            model = TensorNet(element_types=ELEMENTS, cutoff=CUTOFF, is_intensive=False, use_warp=False,
                              dtype=dtype, **SMALL)
            self.potential = Potential(model=model, data_mean=0.1, data_std=1.3, calc_stresses=True).to(dtype)
        self.potential.eval()
        type_of = torch.full((119,), -1, dtype=torch.long)
        for i, symbol in enumerate(ELEMENTS):
            type_of[atomic_numbers[symbol]] = i
        self.register_buffer("type_of", type_of, persistent=False)
        self.dtype = dtype

    def adapt_input(self, batch: Batch):
        from torch_geometric.data import Data

        if batch.num_systems != 1:
            raise ValueError(f"matgl's Potential takes one structure per call (as PESCalculator does), "
                             f"got a batch of {batch.num_systems}")
        sender, receiver = batch.neighbors.edge_index
        cell = batch.cell[0]
        graph = Data(
            edge_index=torch.stack([receiver, sender]),
            pbc_offset=-batch.neighbors.unit_shifts.to(self.dtype),
            frac_coords=batch.positions @ torch.linalg.inv(cell),
            node_type=self.type_of[batch.atomic_numbers.long()],
            num_nodes=batch.positions.shape[0],
        )
        return graph, cell

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        if batch.neighbors is None:
            from mlipdd.neighbors import attach_neighbors

            attach_neighbors(batch, self.cutoff)
        graph, lattice = self.adapt_input(batch)
        with torch.enable_grad():
            energy, forces, stresses, _ = self.potential(graph, lattice)
        result = {"energy": energy.reshape(1), "forces": forces}
        if compute_stress:
            result["stress"] = (stresses / EV_PER_ANG3_TO_GPA).reshape(1, 3, 3)
        return result


def tensornet(seed: int = 0) -> TensorNetPotential:
    return TensorNetPotential(seed=seed)
