"""Graph partition under the aten dispatch (``DomainConfig(strategy="graph_partition")``).

Models that build their own graph (`GraphBuildingMPNN`) equal one process at 2-4 gloo
ranks, float64: a triclinic cell, a cell where a rank sees its own images, a slab, a
batch of two systems; plus a model whose per-system state feeds back into the owned
rows (a sum over the owned block alone would be wrong: the rules complete it). A model
that misuses the partition is refused on every rank, naming the op and the fix.
"""

from __future__ import annotations

import pytest
import torch
from mlipdd.data import InputError
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.shard import graph_partition as gp
from mlipdd.shard.aten import AtenRefusal
from mlipdd.shard.aten.comm import OwnedRowsOnly
from mlipdd.shard.aten.graph_partition import PartitionContext
from mlipdd.strategy.graph_partition import GraphPartitionStrategy
from mlipdd.testing import RankFailure, run_ranks
from mlipdd.testing.conformance import check_conformance_cases
from mlipdd.testing.graph_building_model import GraphBuildingMPNN
from mlipdd.testing.systems import slab, small_cell, triclinic, two_systems

ATEN_GP = {"strategy": "graph_partition"}


def graph_model():
    return GraphBuildingMPNN(cutoff=4.5, layers=3, species=(18, 8))


class _StatefulGraphModel(GraphBuildingMPNN):
    def owned_energies(self, batch, positions, cell, owned_species):
        energies = super().owned_energies(batch, positions, cell, owned_species)
        system = gp.owned_rows(batch.batch)
        state = energies.new_zeros(batch.num_systems).index_add(0, system, energies)
        return energies + 0.1 * torch.tanh(state)[system] * energies


def stateful_model():
    return _StatefulGraphModel(cutoff=4.5, layers=2, species=(18, 8))


class _MeanScaledGraphModel(GraphBuildingMPNN):
    """Scales the owned energies by their mean over all atoms (a mean over the rows: exact)."""

    def owned_energies(self, batch, positions, cell, owned_species):
        energies = super().owned_energies(batch, positions, cell, owned_species)
        return energies * (1 + 0.1 * torch.tanh(energies.mean()))


def mean_scaled_model():
    return _MeanScaledGraphModel(cutoff=4.5, layers=2, species=(18, 8))


def systems():
    return {
        "triclinic": triclinic(species=(18, 8), reps=4),
        "own_images": small_cell(species=(18, 8), reps=2),
        "slab": slab(species=(18, 8), reps=(4, 4, 3)),
        "two_systems": two_systems(species=(18, 8)),
    }


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_graph_partition_exact_under_aten(world_size):
    named = [(name, graph_model, batch) for name, batch in systems().items()]
    named.append(("system state", stateful_model, two_systems(species=(18, 8))))
    named.append(("mean over atoms", mean_scaled_model, triclinic(species=(18, 8), reps=4)))
    cases = [(factory, batch, ATEN_GP) for _, factory, batch in named]
    for (result, _), (name, _, _) in zip(check_conformance_cases(cases, world_size), named):
        for key in ("energy", "forces", "stress"):
            assert result.rel_diff[key] < 1e-12, (name, result.rel_diff)
        assert float(result.reference["forces"].abs().max()) > 1e-3, name  # a real test, not zeros


def test_the_switch_picks_the_aten_graph_partition_and_one_rank_is_the_plain_model():
    config = DomainConfig(cutoff=4.5, **ATEN_GP)
    model, batch = graph_model(), triclinic(species=(18, 8), reps=3)
    dm = DistributedModel(model, config)
    assert isinstance(dm.strategy, GraphPartitionStrategy)
    out = dm(dm.partition(batch.clone()), compute_stress=True)
    reference = model(batch, compute_stress=True)
    for name in ("energy", "forces", "stress"):
        assert torch.allclose(out[name], reference[name], rtol=1e-12, atol=1e-14), name


# ---- refusals -------------------------------------------------------------------------------------


class _SenderReadOfOwnedBlock(GraphBuildingMPNN):
    """Forgets gather_nodes: reads the owned block by sender node numbers."""

    def owned_energies(self, batch, positions, cell, owned_species):
        nl_edges, _ = gp.keep_owned_receivers(*_graph(self, batch, positions, cell))
        h = self.embed[owned_species]
        return (h[nl_edges[0]].sum(1) * 0).sum() + h.sum(1)


class _MedianOverAtoms(GraphBuildingMPNN):
    """Centres the owned features on a median over the atoms (refused: a median over the rows
    has no cross-rank rule; the fix names sums over the rows)."""

    def owned_energies(self, batch, positions, cell, owned_species):
        gp.keep_owned_receivers(*_graph(self, batch, positions, cell))
        h = self.embed[owned_species]
        return (h - h.median(0).values).sum(1)


def _graph(model, batch, positions, cell):
    from mlipdd.data import Batch
    from mlipdd.neighbors import build_neighbor_list

    geometry = Batch._from_dicts({"positions": positions, "batch": batch.batch, "atom_ids": batch.atom_ids},
                                 {"cell": cell, "pbc": batch.pbc})
    nl = build_neighbor_list(geometry, model.cutoff)
    return nl.edge_index, nl.unit_shifts


def _refused_worker(rank, world_size, name):
    factory = {"sender read": _SenderReadOfOwnedBlock, "median": _MedianOverAtoms}[name]
    dm = DistributedModel(factory(cutoff=4.5, layers=1, species=(18, 8)), DomainConfig(cutoff=4.5, **ATEN_GP))
    batch = triclinic(species=(18, 8), reps=3)
    dm(dm.partition(batch if rank == 0 else None))


@pytest.mark.parametrize(("name", "match"), [
    ("sender read", r"refuses `aten::index.*not atom rows.*Fix: .*gather_nodes"),
    ("median", r"refuses `aten::median.*Fix: write it from sums"),
])
def test_misused_partition_is_refused_on_every_rank(name, match):
    with pytest.raises(RankFailure, match=match) as failure:
        run_ranks(_refused_worker, 2, name)
    assert str(failure.value).count("AtenRefusal") >= 2  # each rank names it


def test_owned_slice_and_rows_helpers_refuse_what_they_cannot_place():
    p = gp.NodePartition.balanced(6, 2, 1)
    ctx = PartitionContext(plan=OwnedRowsOnly(p.n_owned), n_edges=0)
    with gp.partition_scope(gp.PartitionScope(p, ctx)) as scope, scope.after_graph:
        with pytest.raises(AtenRefusal, match="owned_slice.*Fix: owned_rows"):
            gp.owned_slice(6)
        rows = gp.owned_rows(torch.arange(6.0).unsqueeze(1))
        assert rows._local.flatten().tolist() == [3.0, 4.0, 5.0]
        with pytest.raises(AtenRefusal, match="sum_over_ranks.*Fix: sum the rows"):
            gp.sum_over_ranks(rows)
        with pytest.raises(AtenRefusal, match="local_receivers.*Fix: pass edge_index"):
            gp.local_receivers(torch.tensor([3, 4]))
        with pytest.raises(InputError, match="gather_nodes"):
            gp.gather_nodes(torch.zeros(6, 2))
