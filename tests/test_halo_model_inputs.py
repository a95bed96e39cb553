"""Extra per-atom float properties (partial charges) reach the model under the halo
strategy; integrator state and integer bookkeeping do not. The multi-rank path (ghost
rows padded from their owners) is checked by plugins/ewald_pme's distributed test,
whose PME/Ewald models read ``charges`` at both ends of every edge."""

import torch
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.models import LennardJones
from mlipdd.strategy.halo import model_inputs
from mlipdd.testing.systems import cubic


def _batch():
    batch = cubic(reps=2)
    batch.add_node_property("charges", torch.linspace(-1, 1, batch.num_atoms, dtype=batch.dtype))
    batch.add_node_property("image", torch.zeros(batch.num_atoms, 3, dtype=torch.long))
    batch.node["velocities"] = torch.zeros_like(batch.positions)
    return batch


def test_model_inputs_are_the_extra_float_properties():
    assert sorted(model_inputs(_batch())) == ["charges"]


def test_one_rank_model_batch_carries_charges():
    model = LennardJones(epsilon=0.01, sigma=3.4, cutoff=6.0)
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff))
    owned = dm.partition(_batch())
    dm(owned)
    assert torch.equal(dm.last_padded.charges, owned.charges)
    assert "image" not in dm.last_padded.node and "velocities" not in dm.last_padded.node
