"""A halo model and a sharded QEq model in one pipeline: the merged spec is sharded
("halo | sharded -> sharded") and the pipeline equals one process at 1-4 ranks."""

import pytest
import torch
from mlipdd.data import InputError
from mlipdd.distributed import DistributedPipelineModel, DomainConfig, StrategyKind
from mlipdd.models.lj import LennardJones
from mlipdd.models.pipeline import PipelineModelWrapper
from mlipdd.spec.presets import SPEC_MPNN_HALO
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import gather_by_id, relative_difference
from mlipdd.testing.qeq_model import QEqModel
from mlipdd.testing.systems import triclinic, two_systems
from mlipdd.testing.toy_models import ToyMPNN

SPECIES = (1, 8)


def pipeline():
    return PipelineModelWrapper([
        ToyMPNN(cutoff=4.0, layers=2, species=SPECIES),
        LennardJones(epsilon={1: 0.002, 8: 0.01}, sigma={1: 2.0, 8: 2.9}, cutoff=5.0),
        QEqModel(cutoff=4.5, species=SPECIES),
    ])


def merged_spec():
    return SPEC_MPNN_HALO | QEqModel(cutoff=4.5, species=SPECIES).distribution_spec()


def neutral_triclinic():
    return triclinic(species=SPECIES, spacing=3.0)


def charged_pair():
    batch = two_systems(species=SPECIES, spacing=3.0)
    batch.system["charge"] = torch.tensor([-1.0, 2.0], dtype=torch.float64)
    return batch


def _pipeline_worker(rank, world_size, batch):
    model = pipeline()
    config = DomainConfig(cutoff=model.cutoff, strategy=StrategyKind.SHARDED)
    dm = DistributedPipelineModel(model, config, spec=merged_spec())
    owned = dm.partition(batch if rank == 0 else None)
    out = dm(owned, compute_stress=True)
    return {"atom_ids": owned.atom_ids, "rebuilds": dm.strategy.rebuilds,
            **{k: out[k] for k in ("energy", "forces", "stress")}}


def test_merged_spec_is_sharded():
    assert merged_spec().distribution.policy.is_sharded()
    assert pipeline().distribution_spec().distribution.policy.is_sharded()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("make", [neutral_triclinic, charged_pair], ids=["triclinic", "two_charged_systems"])
def test_halo_plus_sharded_pipeline_equals_one_process(make, world_size):
    batch = make()
    reference = {k: v.detach() for k, v in pipeline()(batch.clone(), compute_stress=True).items()}
    parts = run_ranks(_pipeline_worker, world_size, batch)
    assert relative_difference(parts[0]["energy"], reference["energy"]) <= 1e-12
    assert relative_difference(parts[0]["stress"], reference["stress"]) <= 1e-10
    forces = gather_by_id(parts, "forces", batch.num_atoms)
    assert relative_difference(forces, reference["forces"]) <= 1e-10
    for p in parts:
        assert p["rebuilds"] == 1  # one neighbour list and request plan for all three blocks


def test_sharded_pipeline_under_the_halo_strategy_is_refused():
    model = pipeline()
    with pytest.raises(InputError, match="does not fit the halo strategy"):
        DistributedPipelineModel(model, DomainConfig(cutoff=model.cutoff), spec=merged_spec())
