"""torch.compile traces the aten-level ShardTensor (one rank, no graph break).

A wrapper subclass with ``__tensor_flatten__`` is desugared by AOTAutograd: the graph
holds the rules' plain aten ops on the local tensors, the placements are static
metadata (guarded through `HaloContext` equality: one compile until a rebuild). Here an
LJ energy over the rows the halo strategy hands a model compiles with
``fullgraph=True``; its value and its gradient (forces through the compiled backward)
equal the eager dispatch.
"""

from __future__ import annotations

import torch
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.models.lj import LennardJones
from mlipdd.shard.aten import REPLICATE, ShardTensor
from mlipdd.testing.systems import triclinic


def pair_energy(positions, edge_index, shifts):
    sender, receiver = edge_index[0], edge_index[1]
    vectors = positions.index_select(0, receiver) + shifts - positions.index_select(0, sender)
    r2 = (vectors * vectors).sum(-1)
    s6 = (3.4**2 / r2) ** 3
    half = 0.5 * 4.0 * 0.0104 * (s6 * s6 - s6)
    per_atom = torch.zeros(positions.shape[0], dtype=positions.dtype).index_add(0, receiver, half)
    return per_atom.sum()


def model_rows():
    model = LennardJones(epsilon=0.0104, sigma=3.4, cutoff=7.0)
    dm = DistributedModel(model, DomainConfig(cutoff=7.0, skin=0.0, strategy="halo"))
    dm.strategy.rows_at_one_rank = True  # NOTE [aten at one rank]: plain tensors otherwise
    owned = dm.partition(triclinic(reps=3))
    dm.prepare(owned)
    batch, _ = dm.strategy.model_batch(owned, dm.spec)
    nl = batch.neighbors
    return batch.positions, nl.edge_index, nl.shifts(batch.cell, batch.batch)


def test_compile_traces_the_aten_shardtensor_fullgraph():
    positions, edge_index, shifts = model_rows()
    assert isinstance(positions, ShardTensor)
    eager = pair_energy(positions, edge_index, shifts)
    (eager_grad,) = torch.autograd.grad(eager, positions)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(pair_energy)(positions, edge_index, shifts)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(pair_energy, backend="aot_eager", fullgraph=True)
    out = compiled(positions, edge_index, shifts)
    assert isinstance(out, ShardTensor) and out.placement == REPLICATE
    assert torch.allclose(out._local, eager._local, rtol=1e-14, atol=0)
    (grad,) = torch.autograd.grad(out, positions)
    assert isinstance(grad, ShardTensor)
    assert torch.allclose(grad._local, eager_grad._local, rtol=1e-12, atol=1e-15)
