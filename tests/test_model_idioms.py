"""Idioms of ordinary models that the scatter and per-system rules alone did not see.

Whole-tensor reductions over the atoms (`WholeSystemMPNN`): a single-system model is
often written with ``q - q.mean()``, ``(q * q).sum()``, ``x.max()``, ``x.amax()`` and
``q @ x``, ``softmax(dim=0)``, ``std`` over all atoms. Each rank holds only some atoms, so these reduce the counted
rows over ranks and come back replicated; their uses per atom then carry the gradient
shares of every rank (NOTE [aten reductions] in mlipdd.shard.aten.reductions).
Before, a whole sum gave each rank only its own share of the gradient (forces off by
~1e-3 relative), and a mean or a max reduced the rank's own rows. Reductions over rows
with no exact cross-rank rule are refused with the fix.

Other spellings of a scatter-add (`DegreeMPNN`): an accumulating ``index_put_``; a mean
aggregation by ``scatter_reduce(..., "mean")`` or ``index_reduce(..., "mean")`` (NOTE [aten
scatter means]). A sparse adjacency matrix built from the edge index is refused by name under
the aten dispatch (the default), halo and sharded storage: its product is a scatter.
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
# counts the skin's
MODELS = {
    "whole_system": (WholeSystemMPNN, {}, SPECS),
    "degree": (DegreeMPNN, {}, SPECS),
    "mean_aggregation": (functools.partial(DegreeMPNN, first_layer="mean"), {"skin": 0.0}, SPECS),
    "index_mean": (functools.partial(DegreeMPNN, first_layer="index_mean"), {"skin": 0.0}, SPECS),
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


# what the aten dispatch refuses: (model, strategy) -> (the op named, a phrase of the fix)
REFUSED = {
    (_MedianOverAtoms, "halo"): ("`aten::median.default`", "x.sum(0), x.amax(0)"),
    (_AllPairs, "sharded"): ("`aten::_cdist_forward.default`", "index_select / index_add / scatter_add"),
    (_AllPairs, "halo"): ("`aten::_euclidean_dist.default`", "index_select / index_add / scatter_add"),
    (functools.partial(DegreeMPNN, first_layer="index_amax"), "halo"):
        ("`aten::index_reduce.default`", "reduce='mean' (a sum and a count)"),
    (functools.partial(DegreeMPNN, first_layer="sparse"), "halo"):
        ("`aten::_sparse_coo_tensor_with_dims_and_tensors.default`", "index_add(0, receiver"),
    (functools.partial(DegreeMPNN, first_layer="sparse"), "sharded"):
        ("`aten::_sparse_coo_tensor_with_dims_and_tensors.default`", "index_add(0, receiver"),
}


def test_what_has_no_cross_rank_rule_is_refused_on_every_rank():
    """Each rank raises the aten refusal, or (when it was waiting in a collective) the first
    rank's refusal relayed by fail_together: either way the op's name and the fix."""
    for (factory, strategy), (op, fix) in REFUSED.items():
        for message in run_ranks(_refusal, 2, factory, strategy, SPECS[strategy]):
            assert message is not None and "mlipdd aten dispatch refuses " + op in message, (strategy, message)
            assert "Fix:" in message and fix in message, (strategy, message)
