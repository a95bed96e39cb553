"""Bad input gets an error naming the problem and the fix, on every rank."""

from __future__ import annotations

import functools

import pytest
import torch
from mlipdd.data import InputError
from mlipdd.testing.spawn import run_ranks
from mlipdd_ewald_pme.testing import distributed_error, rock_salt
from mlipdd_ewald_pme.wrappers import DSFWrapper, EwaldWrapper, PMEWrapper


def _without_charges():
    batch = rock_salt((2, 2, 2))
    del batch.node["charges"]
    return batch


@pytest.mark.parametrize("model", [EwaldWrapper(cutoff=6.0), PMEWrapper(cutoff=6.0), DSFWrapper(cutoff=6.0)])
def test_missing_charges_names_the_fix(model):
    with pytest.raises(InputError, match="add_node_property\\('charges'"):
        model(_without_charges())


@pytest.mark.parametrize("model", [EwaldWrapper(cutoff=6.0), PMEWrapper(cutoff=6.0)])
def test_non_periodic_axis_is_refused_with_dsf_as_the_fix(model):
    batch = rock_salt((2, 2, 2))
    batch.system["pbc"] = torch.tensor([[True, True, False]])
    with pytest.raises(InputError, match="use DSFWrapper"):
        model(batch)
    DSFWrapper(cutoff=6.0)(batch)  # the suggested fix runs


def test_mesh_too_coarse_for_the_accuracy():
    with pytest.raises(InputError, match="too coarse.*use mesh_spacing <="):
        PMEWrapper(cutoff=6.0, accuracy=1e-8, mesh_spacing=2.0)(rock_salt((2, 2, 2)))
    PMEWrapper(cutoff=6.0, accuracy=1e-8, mesh_spacing=0.5)(rock_salt((2, 2, 2)))


def test_unknown_element_charge_and_bad_options():
    with pytest.raises(InputError, match="no charge for atomic numbers \\[17\\]"):
        PMEWrapper(cutoff=6.0, element_charges={"Na": 1.0})(_without_charges())
    with pytest.raises(InputError, match="accuracy must lie in"):
        EwaldWrapper(accuracy=2.0)
    with pytest.raises(InputError, match="spline_order"):
        PMEWrapper(spline_order=9)


def test_every_rank_raises_the_same_error():
    messages = run_ranks(distributed_error, 2, functools.partial(PMEWrapper, cutoff=6.0), _without_charges())
    assert all(m is not None and "add_node_property('charges'" in m for m in messages), messages
