"""A step no per-op rule sees into, run by `mlipdd.shard.call_adapted` under the aten dispatch
(NOTE [aten op adapters], NOTE [adapted reads under sharded storage]), and host reads of
values (NOTE [host reads of replicated values]).

`AdaptedMPNN` is the tests' ToyMPNN with its message sums computed on plain local tensors
inside an adapted call (``ScatterOutputs``: per-node sums of this rank's edges), the way a
chunked or fused plugin does it. Under halo and sharded storage at 2, 3 and 4 spawned gloo
ranks it equals one process (float64; triclinic cell, a cell so small a rank sees its own
images, a slab cut along its vacuum); ``.tolist()`` of a replicated sum reads its numbers,
of atom rows it is refused by name on every rank.
"""

from __future__ import annotations

import pytest
import torch
from mlipdd.shard import call_adapted
from mlipdd.spec import OpAdapter, ScatterOutputs
from mlipdd.testing import RankFailure, run_ranks
from mlipdd.testing.conformance import distributed_outputs, gather_by_id, relative_difference
from mlipdd.testing.systems import slab, small_cell, triclinic
from mlipdd.testing.toy_models import ToyMPNN, cosine_envelope, species_rows

SUMS = OpAdapter("mlipdd_test::summed_messages", output_transforms={0: ScatterOutputs()})


def summed_messages(h, weights, sender, receiver):
    """Plain tensors: this rank's messages summed by receiver on every row of ``h``."""
    return torch.zeros_like(h).index_add(0, receiver, weights * h.index_select(0, sender))


class AdaptedMPNN(ToyMPNN):
    def atomic_energies(self, batch, positions, cell):
        sender, receiver = batch.neighbors.edge_index
        vectors = positions[receiver] + batch.neighbors.shifts(cell, batch.batch) - positions[sender]
        d = vectors.norm(dim=1)
        edges = torch.ones_like(d).sum().tolist()  # a replicated value: every rank reads the same number
        assert edges == float(edges)
        basis = torch.exp(-2.0 * (d.unsqueeze(1) - self.centers) ** 2) * cosine_envelope(d, self.cutoff).unsqueeze(1)
        h = self.embed[species_rows(self, batch.atomic_numbers)]
        for radial, update in zip(self.radial, self.update):
            agg = call_adapted(SUMS, summed_messages, h, basis @ radial, sender, receiver)
            h = h + torch.tanh(agg @ update)
        return h @ self.readout


class ListsRows(ToyMPNN):
    def atomic_energies(self, batch, positions, cell):
        positions.tolist()
        return super().atomic_energies(batch, positions, cell)


def _systems(world_size):
    return [("triclinic", triclinic(reps=4), {}), ("own images", small_cell(reps=2), {}),
            ("slab", slab(reps=(4, 4, 3)), {"grid": (1, 1, world_size)})]


def _each(rank, world_size, strategy):
    return [distributed_outputs(rank, world_size, AdaptedMPNN, batch, {"strategy": strategy, **options}, True)
            for _, batch, options in _systems(world_size)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["halo", "sharded"])
def test_an_adapted_message_sum_equals_one_process(strategy, world_size):
    parts = run_ranks(_each, world_size, strategy, timeout=600)
    assert sum(p[i]["n_ghost"] for p in parts for i in range(3)) > 0, "no remote row was read: nothing tested"
    for i, (name, batch, _) in enumerate(_systems(world_size)):
        reference = AdaptedMPNN()(batch.clone(), compute_stress=True)
        assert torch.allclose(reference["energy"], ToyMPNN()(batch.clone())["energy"], rtol=1e-13), name
        per_rank = [p[i] for p in parts]
        forces = gather_by_id(per_rank, "forces", batch.num_atoms)
        assert relative_difference(per_rank[0]["energy"], reference["energy"].detach()) < 1e-12, name
        assert relative_difference(forces, reference["forces"].detach()) < 1e-10, name
        assert relative_difference(per_rank[0]["stress"], reference["stress"].detach()) < 1e-10, name


def _lists_rows(rank, world_size):
    return distributed_outputs(rank, world_size, ListsRows, triclinic(reps=4), {}, False)


def test_tolist_of_rows_is_refused_by_name_on_every_rank():
    with pytest.raises(RankFailure) as failure:
        run_ranks(_lists_rows, 2, timeout=300)
    assert sorted(failure.value.failures) == [0, 1]
    for text in failure.value.failures.values():
        assert "refuses `Tensor.tolist`" in text, text[-800:]
