"""A pipeline of two models under one halo equals the single-process pipeline."""

import pytest
from mlipdd.data import InputError
from mlipdd.distributed import DistributedModel, DistributedPipelineModel, DomainConfig
from mlipdd.models.lj import LennardJones
from mlipdd.models.pipeline import PipelineModelWrapper
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import check_conformance, gather_by_id
from mlipdd.testing.systems import triclinic, two_systems
from mlipdd.testing.toy_models import ToyMPNN


def pipeline():
    return PipelineModelWrapper([ToyMPNN(cutoff=4.0, species=(18,)), LennardJones(epsilon=0.01, sigma=3.4, cutoff=6.0)])


def _pipeline_worker(rank, world_size, batch):
    model = pipeline()
    dm = DistributedPipelineModel(model, DomainConfig(cutoff=model.cutoff))
    owned = dm.partition(batch if rank == 0 else None)
    out = dm(owned, compute_stress=True)
    return {"atom_ids": owned.atom_ids, "forces": out["forces"], "energy": out["energy"],
            "rebuilds": dm.strategy.rebuilds}


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("make", [triclinic, two_systems])
def test_pipeline_equals_single_process(make, world_size):
    result = check_conformance(pipeline, make(), world_size)
    result.assert_close()


def test_halo_built_once_for_all_blocks():
    batch = triclinic()
    parts = run_ranks(_pipeline_worker, 2, batch)
    assert all(p["rebuilds"] == 1 for p in parts)
    reference = pipeline()(batch)
    forces = gather_by_id(parts, "forces", batch.num_atoms)
    assert float((forces - reference["forces"].detach()).abs().max()) < 1e-10


def test_pipeline_model_needs_a_pipeline():
    with pytest.raises(InputError, match="PipelineModelWrapper"):
        DistributedPipelineModel(ToyMPNN(), DomainConfig(cutoff=4.0))
    assert isinstance(DistributedModel, type)
