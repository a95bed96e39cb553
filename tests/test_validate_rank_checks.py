"""`mlipdd validate`'s own checks: identical weights on every rank, skin edges ignored."""

from __future__ import annotations

import os

import torch
from mlipdd.data import Batch
from mlipdd.models import LennardJones
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.neighbors import build_neighbor_list
from mlipdd.testing.systems import triclinic
from mlipdd.testing.toy_models import ToyMPNN
from mlipdd.validate.rank_checks import (
    check_identical_weights,
    check_ignores_skin_edges,
    model_species,
)


def lj():
    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.5)


def toy_seeded_per_process():
    """The mistake: weights from a seed that differs between processes."""
    return ToyMPNN(seed=int.from_bytes(os.urandom(4), "little"))


class UnmaskedPairs(ModelWrapper):
    """exp(-r) per edge of whatever list it is given: skin edges leak into the energy."""

    def __init__(self, cutoff=4.0):
        super().__init__()
        self.model_config = ModelConfig(NeighborConfig(cutoff), extra={"atomic_numbers": (1, 8)})

    def atomic_energies(self, batch: Batch, positions, cell):
        nl = batch.neighbors if batch.neighbors is not None else build_neighbor_list(batch, self.cutoff)
        sender, receiver = nl.edge_index
        r = (positions[receiver] + nl.shifts(cell, batch.batch) - positions[sender]).norm(dim=1)
        out = torch.zeros(batch.num_atoms, dtype=positions.dtype)
        return out.index_add(0, receiver, torch.exp(-r))


def test_identical_weights_pass_and_fail_with_their_own_message():
    good = check_identical_weights(lj, world_size=2)
    assert good.ok, good.message
    bad = check_identical_weights(toy_seeded_per_process, world_size=2)
    assert not bad.ok
    assert "rank 1 built different weights" in bad.message and "seed" in bad.message


def test_skin_edges_pass_and_fail_with_their_own_message():
    sample = triclinic(species=(18,), spacing=3.0, reps=4)
    assert check_ignores_skin_edges(lj(), sample).ok
    assert check_ignores_skin_edges(ToyMPNN(), triclinic(species=(1, 8), spacing=2.0, reps=4)).ok
    bad = check_ignores_skin_edges(UnmaskedPairs(), triclinic(species=(1, 8), spacing=2.0, reps=4))
    assert not bad.ok
    assert "skin" in bad.message and "exactly zero" in bad.message


def test_species_default_to_the_models_elements():
    assert model_species(UnmaskedPairs()) == (1, 8)
    assert model_species(lj()) is None  # no declared elements: validate keeps argon


def test_validate_command_prints_both_checks(capsys):
    from mlipdd.cli import main

    code = main(["validate", "lj", "--model-arg", "epsilon=0.0104", "--model-arg", "sigma=3.4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[ok] identical weights on every rank" in out
    assert "[ok] edges beyond the cutoff contribute nothing" in out
