"""Constructors and input errors: from_file, from_foundation (offline), heads, elements."""

from __future__ import annotations

import urllib.error

import pytest
import torch
from ase import Atoms
from mace_structures import STRUCTURES

from mlipdd.data import Batch, InputError
from mlipdd_mace import foundation
from mlipdd_mace.testing import random_mace
from mlipdd_mace.wrapper import MACEWrapper


def test_save_then_from_file_round_trip(mace_model, tmp_path):
    path = tmp_path / "random.model"
    torch.save(mace_model, path)
    batch = Batch.from_ase(STRUCTURES["triclinic"]())
    before = MACEWrapper(mace_model)(batch, compute_stress=True)
    after = MACEWrapper.from_file(path)(batch, compute_stress=True)
    for key in ("energy", "forces", "stress", "energies"):
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0)


def test_from_file_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no MACE model file"):
        MACEWrapper.from_file(tmp_path / "nope.model")


def test_from_foundation_offline_fails_clearly(monkeypatch, tmp_path):
    """No network here: the download fails and the error says what to do instead."""
    from mace.calculators import foundations_models

    def offline(url, filename, *args, **kwargs):
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty cache: nothing to reuse
    monkeypatch.setattr(foundations_models, "_urlretrieve_with_timeout", offline)
    for name in ("medium-0b3", "off:small"):
        with pytest.raises(RuntimeError, match="could not load MACE foundation model") as info:
            MACEWrapper.from_foundation(name)
        assert "from_file" in str(info.value)


def test_foundation_names():
    assert foundation.split_foundation_name("medium-mpa-0") == ("mp", "medium-mpa-0")
    assert foundation.split_foundation_name("off:small") == ("off", "small")
    assert "off:large" in foundation.known_foundation_names()
    with pytest.raises(ValueError, match="unknown MACE foundation family"):
        foundation.split_foundation_name("orb:v3")
    with pytest.raises(ValueError, match="unknown MACE-MP foundation model"):
        foundation.load_foundation("gigantic")


def test_unknown_element_names_element_and_model_elements(mace_model):
    atoms = Atoms(["C", "H", "Fe"], positions=[[0, 0, 0], [1.0, 0, 0], [0, 1.5, 0]])
    with pytest.raises(InputError, match=r"Fe \(Z=26\).*H C O"):
        MACEWrapper(mace_model)(Batch.from_ase(atoms))


def test_not_a_mace_model_is_rejected():
    with pytest.raises(TypeError, match="mace.modules.MACE"):
        MACEWrapper(torch.nn.Linear(3, 3))


def test_multi_head_model_head_choice():
    model = random_mace(heads=("pbe", "r2scan"), seed=2)
    with pytest.raises(ValueError, match="choose one with MACEWrapper"):
        MACEWrapper(model)
    with pytest.raises(ValueError, match="no head 'hse'"):
        MACEWrapper(model, head="hse")
    batch = Batch.from_ase(STRUCTURES["tiny_cell"]())
    energies = {h: MACEWrapper(model, head=h)(batch)["energy"].item() for h in ("pbe", "r2scan")}
    assert energies["pbe"] != energies["r2scan"]  # each head has its own readout and E0s
