"""sevenn's SevenNet (a NequIP-style E(3)-equivariant network), built from its own config.

`build_E3_equivariant_model` on sevenn's default model config
(`sevenn._const.DEFAULT_E3_EQUIVARIANT_MODEL_CONFIG`) with two species, a smaller width
and two convolutions; a float denominator and shift/scale take the place of the
statistics sevenn's trainer computes from a data set. That is the model
`SevenNetCalculator` runs (`Checkpoint.build_model` calls the same builder), with its
`ForceStressOutputFromEdge`: forces and stress from the energy's gradient with respect
to the edge vectors, scattered onto atoms inside sevenn. Weights are random, drawn from
a seeded torch RNG (the same on every rank), in float64.

The input is sevenn's batched graph dict, filled from the batch as its torch-sim
interface fills it (`sevenn.torchsim`): edge vectors computed in torch from positions.
sevenn's ``edge_index[0]`` is the centre atom that gathers the messages (our receiver),
``edge_index[1]`` its neighbour, ``edge_vec = pos[edge_index[1]] - pos[edge_index[0]] + shift``:
the batch's edge vector reversed.
"""

from __future__ import annotations

import copy

import torch

from mlipdd.data import Batch
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.testing.real_packages.building import seeded_build

CUTOFF = 4.5  # sevenn's default
SMALL = {"channel": 8, "lmax": 2, "num_convolution_layer": 2, "weight_nn_hidden_neurons": [16, 16],
         "conv_denominator": 12.0, "is_parity": False}


def config(species=("H", "O"), **overrides) -> dict:
    """sevenn's model config: its defaults, the species' type map, SMALL, ``overrides``."""
    import sevenn._keys as KEY
    from sevenn import _const
    from sevenn.util import chemical_species_preprocess

    cfg = copy.deepcopy(_const.model_defaults({}))
    cfg.update(chemical_species_preprocess(list(species)))
    cfg.update({KEY.CUTOFF: CUTOFF, KEY.NODE_FEATURE_MULTIPLICITY: SMALL["channel"], KEY.LMAX: SMALL["lmax"],
                KEY.NUM_CONVOLUTION: SMALL["num_convolution_layer"],
                KEY.CONVOLUTION_WEIGHT_NN_HIDDEN_NEURONS: SMALL["weight_nn_hidden_neurons"],
                KEY.CONV_DENOMINATOR: SMALL["conv_denominator"], KEY.IS_PARITY: SMALL["is_parity"],
                KEY.SHIFT: -1.5, KEY.SCALE: 1.3})
    cfg.update(overrides)
    return cfg


class _OnehotIn(torch.nn.Module):
    """sevenn's `OnehotEmbedding`, its output cast to ``dtype``: sevenn writes ``embd.float()``
    (float32 always), which a float64 model's first linear layer cannot take. The only
    change made to sevenn's model, through its own ``replace_module``."""

    def __init__(self, onehot, dtype):
        super().__init__()
        self.onehot, self.dtype = onehot, dtype

    def forward(self, data):
        data = self.onehot(data)
        for key in (self.onehot.key_output, self.onehot.key_additional_output):
            if key is not None:
                data[key] = data[key].to(self.dtype)
        return data


class SevenNetPotential(ModelWrapper):
    """energy, forces and stress of a SevenNet `AtomGraphSequential`."""

    def __init__(self, seed: int = 0, dtype=torch.float64):
        super().__init__()
        from sevenn.model_build import build_E3_equivariant_model

        self.model_config = ModelConfig(NeighborConfig(CUTOFF), extra={"atomic_numbers": (1, 8)})
        with seeded_build(seed, dtype):  # e3nn's generated code keeps constants of the default dtype
            self.model = build_E3_equivariant_model(config())
        if dtype != torch.float32:
            key = "onehot_idx_to_onehot"
            self.model.replace_module(key, _OnehotIn(self.model._modules[key], dtype))
        self.model = self.model.to(dtype).eval()
        self.dtype = dtype

    def adapt_input(self, batch: Batch) -> dict:
        import sevenn._keys as KEY

        sender, receiver = batch.neighbors.edge_index
        numbers = batch.atomic_numbers.long()
        return {
            KEY.NODE_FEATURE: numbers,  # sevenn's placeholder, replaced by the type index
            KEY.ATOMIC_NUMBERS: numbers,
            KEY.POS: batch.positions,
            KEY.EDGE_IDX: torch.stack([receiver, sender]),
            KEY.EDGE_VEC: -batch.neighbors.edge_vectors(batch.positions, batch.cell, batch.batch),
            KEY.CELL_VOLUME: torch.linalg.det(batch.cell).abs(),
            KEY.NUM_ATOMS: torch.bincount(batch.batch, minlength=batch.num_systems),
            KEY.BATCH: batch.batch,
        }

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        import sevenn._keys as KEY

        if batch.neighbors is None:
            from mlipdd.neighbors import attach_neighbors

            attach_neighbors(batch, self.cutoff)
        with torch.enable_grad():
            out = self.model(self.adapt_input(batch))
        result = {"energy": out[KEY.PRED_TOTAL_ENERGY], "forces": out[KEY.PRED_FORCE]}
        if compute_stress:
            # sevenn's (n, 6) [xx, yy, zz, xy, yz, zx], minus ASE's sign (SevenNetCalculator negates it)
            xx, yy, zz, xy, yz, zx = (-out[KEY.PRED_STRESS]).unbind(-1)
            result["stress"] = torch.stack([torch.stack([xx, xy, zx], -1), torch.stack([xy, yy, yz], -1),
                                            torch.stack([zx, yz, zz], -1)], -2)
        return result


def sevennet(seed: int = 0) -> SevenNetPotential:
    return SevenNetPotential(seed=seed)
