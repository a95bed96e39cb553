"""The plugin's hooks, called directly and through the core's plugin manager."""

from __future__ import annotations

import pytest
import torch
from mace_structures import STRUCTURES

import mlipdd.plugins as mlipdd_plugins
from mlipdd.data import Batch
from mlipdd.spec import SPEC_MPNN_HALO
from mlipdd_mace import plugin
from mlipdd_mace.wrapper import MACEWrapper, is_mace_model


def _collect(hook) -> dict:
    found = {}
    hook(lambda name, value, description="": found.__setitem__(name, value))
    return found


def test_register_models_hook_offers_mace():
    models = _collect(plugin.mlipdd_register_models)
    assert set(models) == {"mace"}


def test_factory_takes_exactly_one_source(mace_model, tmp_path):
    assert isinstance(plugin.make_mace_model(mace_model), MACEWrapper)
    path = tmp_path / "m.model"
    torch.save(mace_model, path)
    assert isinstance(plugin.make_mace_model(path=path), MACEWrapper)
    with pytest.raises(ValueError, match="exactly one of"):
        plugin.make_mace_model()
    with pytest.raises(ValueError, match="got model, path"):
        plugin.make_mace_model(mace_model, path=path)
    with pytest.raises(TypeError, match="pass path="):
        plugin.make_mace_model(str(path))


def test_wrap_model_hook_recognises_only_mace(mace_model):
    assert plugin.mlipdd_wrap_model(torch.nn.Linear(2, 2), {}) is None
    assert not is_mace_model(object())
    wrapped = plugin.mlipdd_wrap_model(mace_model, {"head": None})
    assert isinstance(wrapped, MACEWrapper)


def test_preset_alias_is_the_mpnn_halo_preset():
    assert _collect(plugin.mlipdd_register_presets) == {"SPEC_MACE_HALO": SPEC_MPNN_HALO}


def test_distribution_spec_is_halo(mace_model):
    assert MACEWrapper(mace_model).distribution_spec() is SPEC_MPNN_HALO


@pytest.fixture
def plugins():
    """The core's plugin system with a freshly discovered registry (entry points)."""
    mlipdd_plugins.reset_registry()
    yield mlipdd_plugins
    mlipdd_plugins.reset_registry()


def test_entry_point_discovered_by_core(plugins, monkeypatch):
    monkeypatch.delenv("MLIPDD_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    reg = plugins.registry()
    assert "mace" in reg.models, f"mace plugin not found; failures: {reg.failed}"
    assert not [f for f in reg.failed if f.name == "mace"]


def test_core_wrap_model_and_create_model(plugins, monkeypatch, mace_model):
    monkeypatch.delenv("MLIPDD_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    wrapped = plugins.wrap_model(mace_model)
    assert isinstance(wrapped, MACEWrapper)
    created = plugins.create_model("mace", model=mace_model)
    batch = Batch.from_ase(STRUCTURES["tiny_cell"]())
    torch.testing.assert_close(wrapped(batch)["forces"], created(batch)["forces"], rtol=0, atol=0)
