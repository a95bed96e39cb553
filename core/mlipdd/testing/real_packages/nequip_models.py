"""nequip's NequIP, built by its own model builder (`nequip.model.NequIPGNNModel`).

The builder takes ``seed`` and ``model_dtype`` itself (random weights, the same on every
rank, float64); a small model (two layers, l_max 1, 8 features) with a given
``avg_num_neighbors`` and per-type scale/shift in place of the training set's
statistics. Forces and stress by autograd inside nequip (``do_derivatives``).

The input is nequip's `AtomicDataDict`, filled from the batch as `NequIPCalculator`'s
transforms fill it from one structure (its neighbour list runs on its own copy and never
sees a distributed batch): nequip's ``edge_index[0]`` is the centre atom that sums the
messages (our receiver), ``edge_index[1]`` its neighbour, with
``edge_vec = pos[edge_index[1]] - pos[edge_index[0]] + edge_cell_shift @ cell``: the
batch's edge reversed.

nequip is not in the test extra: 0.19 needs torchmetrics>=1.6, schnetpack 2.0.4 pins 1.0.1.
"""

from __future__ import annotations

import torch

from mlipdd.data import Batch
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.testing.real_packages.building import seeded_build

CUTOFF = 4.5
TYPES = ("H", "O")
SMALL = {"num_layers": 2, "l_max": 1, "num_features": 8, "radial_mlp_width": 16, "avg_num_neighbors": 12.0,
         "per_type_energy_scales": 1.3, "per_type_energy_shifts": -1.5}


class NequIPPotential(ModelWrapper):
    """energy, forces and stress of a nequip `GraphModel` (NequIP)."""

    def __init__(self, seed: int = 0, dtype=torch.float64):
        super().__init__()
        from nequip.model import NequIPGNNModel
        from nequip.utils.global_state import set_global_state

        self.model_config = ModelConfig(NeighborConfig(CUTOFF), extra={"atomic_numbers": (1, 8)})
        with seeded_build(None):
            # nequip's entry points call this first (its builder asserts it); it seeds every RNG
            # and sets torch's default dtype to float64, which nequip's modules are built under
            # (constants made in float32 and cast lose digits); put back once built
            set_global_state()
            self.model = NequIPGNNModel(seed=seed, model_dtype=str(dtype).removeprefix("torch."), r_max=CUTOFF,
                                        type_names=list(TYPES), **SMALL)
        self.model.eval()
        type_of = torch.full((119,), -1, dtype=torch.long)
        type_of[1], type_of[8] = 0, 1
        self.register_buffer("type_of", type_of, persistent=False)
        self.dtype = dtype

    def adapt_input(self, batch: Batch) -> dict:
        from nequip.data import AtomicDataDict as K

        sender, receiver = batch.neighbors.edge_index
        return {
            K.POSITIONS_KEY: batch.positions,
            K.EDGE_INDEX_KEY: torch.stack([receiver, sender]),
            K.EDGE_CELL_SHIFT_KEY: -batch.neighbors.unit_shifts.to(self.dtype),
            K.CELL_KEY: batch.cell,
            K.PBC_KEY: batch.pbc.view(-1, 3),
            K.ATOM_TYPE_KEY: self.type_of[batch.atomic_numbers.long()],
            K.BATCH_KEY: batch.batch,
            K.NUM_NODES_KEY: torch.bincount(batch.batch, minlength=batch.num_systems),
        }

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        from nequip.data import AtomicDataDict as K

        if batch.neighbors is None:
            from mlipdd.neighbors import attach_neighbors

            attach_neighbors(batch, self.cutoff)
        with torch.enable_grad():
            out = self.model(self.adapt_input(batch))
        result = {"energy": out[K.TOTAL_ENERGY_KEY].view(-1), "forces": out[K.FORCE_KEY]}
        if compute_stress:
            result["stress"] = out[K.STRESS_KEY].view(-1, 3, 3)
        return result


def nequip(seed: int = 0) -> NequIPPotential:
    return NequIPPotential(seed=seed)
