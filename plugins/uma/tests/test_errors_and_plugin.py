"""Clear errors (float64, unknown task, offline download, missing file, unsupported
fairchem) and the plugin's registrations."""

from __future__ import annotations

import pytest
import torch
from mlipdd_uma.testing import random_uma
from mlipdd_uma.versions import UnsupportedFairchemError, require_fairchem
from mlipdd_uma.wrapper import UMAWrapper
from uma_systems import triclinic_cell


@pytest.fixture(scope="module")
def model():
    return random_uma(seed=2)


def test_float64_batch_is_refused_with_the_fix(model):
    batch = triclinic_cell().to(dtype=torch.float64)
    with pytest.raises(ValueError, match="float32 only.*batch.to\\(dtype=torch.float32\\)"):
        UMAWrapper(model, task="omat")(batch)


def test_float64_model_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="float32 only.*model.float\\(\\)"):
        UMAWrapper(random_uma(seed=2).double(), task="omat")


def test_task_must_be_known_and_chosen(model):
    with pytest.raises(ValueError, match="several tasks.*task="):
        UMAWrapper(model)
    with pytest.raises(ValueError, match="no task 'oc20'"):
        UMAWrapper(model, task="oc20")


def test_non_uma_model_is_refused():
    with pytest.raises(TypeError, match="eSCN-MD backbone"):
        UMAWrapper(torch.nn.Linear(2, 2))


def test_offline_pretrained_fails_clearly():
    with pytest.raises(RuntimeError, match="could not fetch the UMA model 'uma-s-1p1'.*from_checkpoint"):
        UMAWrapper.from_pretrained("uma-s-1p1")
    with pytest.raises(ValueError, match="unknown UMA model name"):
        UMAWrapper.from_pretrained("not-a-model")


def test_missing_checkpoint_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no UMA checkpoint.*from_pretrained"):
        UMAWrapper.from_checkpoint(tmp_path / "missing.pt")


def test_unsupported_fairchem_versions_are_refused():
    assert require_fairchem("2.24.0") == "2.24.0"
    with pytest.raises(UnsupportedFairchemError, match="outside the range"):
        require_fairchem("2.30.1")


def test_plugin_registers_model_and_preset(model):
    from mlipdd.plugins import create_model, get_preset

    spec = get_preset("SPEC_UMA_HALO")
    assert spec.policy.is_halo() and "stress" in spec.all_reduce_outputs
    wrapper = create_model("uma", model=model, task="omat")
    assert isinstance(wrapper, UMAWrapper) and wrapper.cutoff == 4.0
    with pytest.raises(ValueError, match="exactly one of"):
        create_model("uma")


def test_specs_per_strategy_and_adapters_restore(model):
    from fairchem.core.models.uma.escn_md import eSCNMDBackbone
    from mlipdd.spec import installed
    from mlipdd.strategy.kinds import StrategyKind

    wrapper = UMAWrapper(model, task="omat")
    assert wrapper.distribution_spec().name == "uma_halo"
    gp = wrapper.distribution_spec(StrategyKind.GRAPH_PARTITION)
    assert gp.policy.is_graph_partition()
    original = eSCNMDBackbone._generate_graph
    batch = triclinic_cell()
    plain = wrapper(batch.clone(), compute_stress=True)
    for spec in (wrapper.distribution_spec(), gp):
        with installed(spec):  # plain tensors, no partition: the adapters delegate
            again = wrapper(batch.clone(), compute_stress=True)
        assert eSCNMDBackbone._generate_graph is original
        # fairchem on CPU is not bitwise reproducible from call to call (measured: 2e-6 on
        # an energy of 27, 4e-6 on forces); the adapters would change far more
        for key in ("energy", "forces", "stress"):
            assert torch.allclose(again[key], plain[key], rtol=1e-5, atol=1e-5), key
