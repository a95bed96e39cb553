"""PipelineModelWrapper sums its members."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from ase.build import bulk
from mlipdd.data import AtomicData, Batch, InputError
from mlipdd.models.lj import LennardJones
from mlipdd.models.pipeline import PipelineModelWrapper


def systems():
    atoms = bulk("Ar", "fcc", a=5.3, cubic=True).repeat((2, 2, 3))
    atoms.set_cell(
        atoms.cell[:] @ (np.eye(3) + 0.04 * np.triu(np.ones((3, 3)), 1)), scale_atoms=True
    )
    atoms.rattle(0.08, seed=0)
    crystal = AtomicData.from_ase(atoms)
    rng = np.random.default_rng(1)
    cluster = AtomicData(rng.random((15, 3)) * 8.0, [18] * 15, dtype=torch.float64)
    return crystal, cluster


def members():
    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=7.0), LennardJones(
        epsilon={18: 0.02}, sigma={18: 3.1}, cutoff=9.5, shift=False
    )


@pytest.mark.parametrize("which", ["crystal", "batch"])
def test_lj_plus_lj_equals_sum(which):
    crystal, cluster = systems()
    batch = crystal if which == "crystal" else Batch.from_data_list([crystal, cluster])
    first, second = members()
    pipeline = PipelineModelWrapper([first, second])
    out = pipeline(batch, compute_stress=True)
    a, b = first(batch, compute_stress=True), second(batch, compute_stress=True)
    assert set(out) == {"energy", "energies", "forces", "stress"}
    for key in out:
        expected = a[key] + b[key]
        assert torch.allclose(out[key], expected, rtol=1e-13, atol=0), key
    assert batch.neighbors is None  # the shared list went on a view, not the caller's batch


def test_config_and_members():
    first, second = members()
    pipeline = PipelineModelWrapper([first, second])
    assert pipeline.cutoff == 9.5
    assert list(pipeline.models) == [first, second]
    assert pipeline.model_config.outputs == frozenset({"energy", "forces", "stress"})
    with pytest.raises(InputError, match="at least one model"):
        PipelineModelWrapper([])
    with pytest.raises(InputError, match="ModelWrapper instances"):
        PipelineModelWrapper([torch.nn.Linear(2, 2)])


@dataclass(frozen=True)
class _UnionSpec:
    """Stands in for the spec classes (written elsewhere): `|` takes the union of tags."""

    tags: frozenset

    def __or__(self, other):
        return _UnionSpec(self.tags | other.tags)


class _SpecLJ(LennardJones):
    def __init__(self, tag, **kw):
        super().__init__(**kw)
        self.tag = tag

    def distribution_spec(self, strategy=None):
        return None if self.tag is None else _UnionSpec(frozenset({(self.tag, strategy)}))


def test_distribution_spec_merges_member_specs():
    assert PipelineModelWrapper(list(members())).distribution_spec() is None
    pipeline = PipelineModelWrapper([_SpecLJ("a"), _SpecLJ(None), _SpecLJ("b")])
    merged = pipeline.distribution_spec("halo")
    assert merged == _UnionSpec(frozenset({("a", "halo"), ("b", "halo")}))
