"""The plugin's registrations, raw-model wrapping, the specs, and input errors in one process."""

from __future__ import annotations

import pytest
import torch
from aimnet2_systems import DSF_CUTOFF, triclinic_crystal
from mlipdd.data import AtomicData, Batch, InputError
from mlipdd.spec.errors import SpecError
from mlipdd_aimnet2.building import random_aimnet2
from mlipdd_aimnet2.testing import molecular_crystal
from mlipdd_aimnet2.wrapper import AIMNet2Wrapper


@pytest.fixture(scope="module")
def model():
    return random_aimnet2(seed=1)[0]


def test_plugin_is_listed_and_registers_model_and_presets(model):
    from mlipdd.plugins import create_model, get_plugin_manager, get_preset

    assert "aimnet2" in [name for name, _ in get_plugin_manager().list_name_plugin()]
    sharded, halo = get_preset("SPEC_AIMNET2_SHARDED"), get_preset("SPEC_AIMNET2_HALO")
    assert sharded.policy.is_sharded() and halo.policy.is_halo()
    assert "charges" in sharded.output_kinds and "stress" in sharded.all_reduce_outputs
    wrapper = create_model("aimnet2", model=model, dispersion=False)
    assert isinstance(wrapper, AIMNet2Wrapper) and wrapper.cutoff == 15.0 and wrapper.coulomb == "dsf"
    with pytest.raises(ValueError, match="exactly one of"):
        create_model("aimnet2")


def test_wrap_model_recognises_a_raw_aimnet_model(model):
    from mlipdd.plugins import wrap_model

    wrapper = wrap_model(model, dispersion=False, dsf_cutoff=DSF_CUTOFF)
    assert isinstance(wrapper, AIMNet2Wrapper) and wrapper.cutoff == DSF_CUTOFF
    with pytest.raises(ValueError, match="DFT-D3.*dispersion=False"):
        wrap_model(model)  # the released layout asks for D3 outside the network
    with pytest.raises(TypeError, match="AIMNet2 model"):
        AIMNet2Wrapper(torch.nn.Linear(2, 2))


def test_specs_leave_one_process_results_unchanged(model):
    from mlipdd.spec import installed
    from mlipdd.strategy.kinds import StrategyKind

    wrapper = AIMNet2Wrapper(model, dispersion=False, dsf_cutoff=DSF_CUTOFF)
    batch = triclinic_crystal()
    plain = wrapper(batch.clone(), compute_stress=True)
    for strategy in (StrategyKind.SHARDED, StrategyKind.HALO):
        with installed(wrapper.distribution_spec(strategy)):
            again = wrapper(batch.clone(), compute_stress=True)
        for key in ("energy", "forces", "stress", "charges"):
            assert torch.equal(again[key], plain[key]), key
    assert wrapper.distribution_spec().name == "aimnet2_sharded"
    with pytest.raises(SpecError, match="no spec for the .graph_partition. strategy.*halo, sharded"):
        wrapper.distribution_spec(StrategyKind.GRAPH_PARTITION)


def test_checks_read_once_still_see_every_change(model):
    """The species and charge checks are read from the device once while the same tensors hold
    (`HostReads`); an element or charge written in place, or a new charge tensor, is checked again."""
    wrapper = AIMNet2Wrapper(model, dispersion=False, dsf_cutoff=DSF_CUTOFF)
    batch = triclinic_crystal()
    batch.node["atomic_numbers"] = batch.atomic_numbers.clone()
    wrapper(batch)
    wrapper(batch)  # the memo's hit
    batch.atomic_numbers[0] = 92  # in place: the tensor's version moves
    with pytest.raises(InputError, match=r"not trained on atomic number\(s\) \[92\]"):
        wrapper(batch)
    batch.atomic_numbers[0] = 1
    wrapper(batch)
    batch.system["charge"] = torch.tensor([0.0], dtype=torch.float64)
    wrapper(batch)
    batch.system["charge"] = torch.tensor([0.5], dtype=torch.float64)  # a new tensor
    with pytest.raises(InputError, match="not an integer"):
        wrapper(batch)
    batch.system["charge"][0] = 1.0
    wrapper(batch)
    batch.system["charge"][0] = -0.5
    with pytest.raises(InputError, match="not an integer"):
        wrapper(batch)


def test_bad_input_is_refused_with_the_fix(model):
    wrapper = AIMNet2Wrapper(model, dispersion=False, dsf_cutoff=DSF_CUTOFF)
    crystal = triclinic_crystal()
    uranium = crystal.clone()
    uranium.node["atomic_numbers"] = uranium.atomic_numbers.clone()
    uranium.atomic_numbers[3] = 92
    with pytest.raises(InputError, match=r"not trained on atomic number\(s\) \[92\].*remove those atoms"):
        wrapper(uranium)
    half = crystal.clone()
    half.system["charge"] = torch.tensor([0.5], dtype=torch.float64)
    with pytest.raises(InputError, match="not an integer.*whole numbers"):
        wrapper(half)
    pair = molecular_crystal((1, 1, 2))
    molecule = Batch.from_data_list([AtomicData(positions=pair.positions, atomic_numbers=pair.atomic_numbers)])
    narrow = AIMNet2Wrapper(model, dispersion=False, coulomb="simple", simple_cutoff=3.0)
    with pytest.raises(InputError, match=r"system\(s\) \[0\] take the all-pairs.*raise simple_cutoff"):
        narrow(molecule)
    with pytest.raises(ValueError, match="exactly the keys"):
        AIMNet2Wrapper(model, dispersion=False, coulomb={"molecule": "simple"})
    with pytest.raises(ValueError, match="cannot be the periodic method"):
        AIMNet2Wrapper(model, dispersion=False, coulomb={"molecule": "dsf", "periodic": "simple"})
    all_pairs = AIMNet2Wrapper(model, dispersion=False, coulomb="simple")
    with pytest.raises(InputError, match="cannot sum a periodic cell.*coulomb='dsf'"):
        all_pairs(crystal)
    with pytest.raises(InputError, match="float32.*batch.to"):
        wrapper(crystal.to(dtype=torch.float32))
    assert all_pairs(molecule)["energy"].isfinite().all()
