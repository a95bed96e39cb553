"""Idioms of ordinary models that the scatter and per-system rules alone did not see.

Whole-tensor reductions over the atoms (`WholeSystemMPNN`): a single-system model is
often written with ``q - q.mean()``, ``(q * q).sum()``, ``x.max()``, ``x.amax()`` and
``q @ x``, ``softmax(dim=0)``, ``std`` over all atoms. Each rank holds only some atoms, so these reduce the counted
rows over ranks and come back replicated; their uses per atom then carry the gradient
shares of every rank (NOTE [whole sums are replicated] in mlipdd.shard.handlers).
Before, a whole sum gave each rank only its own share of the gradient (forces off by
~1e-3 relative), and a mean or a max reduced the rank's own rows. Reductions over rows
with no exact cross-rank rule are refused with the fix.

Other spellings of a scatter-add (`DegreeMPNN`, mlipdd.shard.scatter_spellings): an
accumulating ``index_put_``; a mean aggregation by ``scatter_reduce(..., "mean")`` or
``index_reduce(..., "mean")``; a sparse adjacency matrix times the features (halo
storage; refused under sharded storage, where remote columns do not fit the matrix).
"""

import functools

import pytest
import torch
from mlipdd.spec.presets import SPEC_MPNN_HALO, SPEC_MPNN_SHARDED
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import distributed_outputs, gather_by_id, relative_difference
from mlipdd.testing.ordinary_models import DegreeMPNN, WholeSystemMPNN
from mlipdd.testing.systems import slab, small_cell, triclinic

SPECIES = (1, 8)
SPECS = {"halo": SPEC_MPNN_HALO, "sharded": SPEC_MPNN_SHARDED}
# model -> (factory, DomainConfig options, strategies): a mean over the listed edges
# counts the skin's; a sparse atoms x atoms matrix is refused under sharded storage
MODELS = {
    "whole_system": (WholeSystemMPNN, {}, SPECS),
    "degree": (DegreeMPNN, {}, SPECS),
    "mean_aggregation": (functools.partial(DegreeMPNN, first_layer="mean"), {"skin": 0.0}, SPECS),
    "index_mean": (functools.partial(DegreeMPNN, first_layer="index_mean"), {"skin": 0.0}, SPECS),
    "sparse_adjacency": (functools.partial(DegreeMPNN, first_layer="sparse"), {}, ("halo",)),
}
SYSTEMS = {
    "triclinic": lambda: triclinic(species=SPECIES, spacing=3.0, reps=4),
    "own_images": lambda: small_cell(species=SPECIES, spacing=2.6, reps=3),
    # cut along the vacuum axis only: with 4 ranks some own no atom at all
    "slab_with_vacuum": lambda: slab(species=SPECIES, spacing=3.0, reps=(3, 3, 2), vacuum=14.0),
}


def _options(strategy, system, world_size, extra):
    return {"strategy": strategy, **extra, **({"grid": (1, 1, world_size)} if system.startswith("slab") else {})}


def _every_case(rank, world_size):
    return {
        (model, strategy, system): distributed_outputs(rank, world_size, factory, make(),
                                                       _options(strategy, system, world_size, extra), True, spec)
        for model, (factory, extra, strategies) in MODELS.items()
        for strategy, spec in SPECS.items() if strategy in strategies
        for system, make in SYSTEMS.items()
    }


@pytest.mark.old_dispatch("issue 21 (h1): aten::mean over the atom rows has no rule yet")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ordinary_idioms_equal_one_process(world_size):
    parts = run_ranks(_every_case, world_size, timeout=600)
    for model, strategy, system in parts[0]:
        batch = SYSTEMS[system]()
        reference = MODELS[model][0]()(batch.clone(), compute_stress=True)
        ranks = [p[model, strategy, system] for p in parts]
        forces = gather_by_id(ranks, "forces", batch.num_atoms)
        for key, value in (("energy", ranks[0]["energy"]), ("forces", forces), ("stress", ranks[0]["stress"])):
            diff = relative_difference(value, reference[key].detach())
            assert diff <= 1e-10, (model, strategy, system, key, diff)
        for r in ranks[1:]:
            assert relative_difference(r["energy"], ranks[0]["energy"]) < 1e-14


class _MedianOverAtoms(WholeSystemMPNN):
    """Shifts by the median over all atoms: no exact cross-rank rule."""

    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        return energies - energies.median()


class _AllPairs(WholeSystemMPNN):
    """A pair term over all pairs of atoms (torch.cdist), not over the neighbour list."""

    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        return energies + torch.exp(-torch.cdist(positions, positions)).sum(1)


def _refusal(rank, world_size, factory, strategy, spec):
    try:
        distributed_outputs(rank, world_size, factory, triclinic(species=SPECIES, spacing=3.0, reps=3),
                            {"strategy": strategy}, False, spec)
    except Exception as error:  # noqa: BLE001 - its own refusal, or the first rank's relayed
        return str(error)
    return None


@pytest.mark.old_dispatch("issue 21 (h1): expects the old no-rule message; aten refuses the model's earlier mean")
def test_what_has_no_cross_rank_rule_is_refused_on_every_rank():
    """Each rank raises the refusal, or (when it was waiting in a collective) the first
    rank's refusal relayed by fail_together: either way the message with the fix."""
    for message in run_ranks(_refusal, 2, _MedianOverAtoms, "halo", SPEC_MPNN_HALO):
        assert message is not None and "`median` over the atom/edge rows" in message
        assert "index_add/scatter_add" in message
    for message in run_ranks(_refusal, 2, _AllPairs, "sharded", SPEC_MPNN_SHARDED):
        assert message is not None and "torch.cdist over the atoms (all pairs)" in message
        assert "neighbour list" in message
    for message in run_ranks(_refusal, 2, functools.partial(DegreeMPNN, first_layer="index_amax"), "halo",
                             SPEC_MPNN_HALO):
        assert message is not None and "index_reduce(reduce='amax') into atom rows" in message
    sparse = functools.partial(DegreeMPNN, first_layer="sparse")
    for message in run_ranks(_refusal, 2, sparse, "sharded", SPEC_MPNN_SHARDED):
        assert message is not None and "sparse atoms x atoms matrix under sharded storage" in message
        assert "index_add" in message
