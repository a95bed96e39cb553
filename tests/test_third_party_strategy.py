"""A third party's strategy and storage policy, defined in this file with no core edit.

`SlabHalo` is the halo strategy with another partitioner: slabs across the cell's widest
plane spacing instead of the least-halo grid. It is registered from an in-process plugin
(again in each spawned rank, a fresh process), gets its spec through a plugin-style
spec chooser (`fitting_spec`), runs forces and MD through `DistributedModel` and
`DomainParallel`, equals one process, and reports through `Strategy.report` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from mlipdd import plugins
from mlipdd.distributed import DistributedModel, DomainConfig, DomainParallel
from mlipdd.dynamics import NVE, initialize_velocities
from mlipdd.dynamics.hooks.trajectory import unwrapped_positions
from mlipdd.hookspecs import hookimpl
from mlipdd.spec import SPEC_MPNN_HALO, SPEC_MPNN_SHARDED, HaloStoragePolicy, merge_policies
from mlipdd.spec.errors import SpecError
from mlipdd.strategy import HaloPlanner, HaloStrategy, fitting_spec
from mlipdd.strategy.grid import RankGrid, plane_spacings
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import gather_by_id, relative_difference
from mlipdd.testing.systems import long_triclinic
from mlipdd.testing.toy_models import ToyMPNN

PLUGIN = "slab_halo_plugin"


class SlabPlanner(HaloPlanner):
    """Every rank on one axis: the one with the widest plane spacing (system 0's)."""

    def grid_for(self, cell: torch.Tensor) -> RankGrid:
        if self.grid is None:
            dims = [1, 1, 1]
            dims[int(plane_spacings(cell.detach())[0].argmax())] = self.world_size
            self.grid = RankGrid(tuple(dims))
        return self.grid


class SlabHalo(HaloStrategy):
    name = "slab_halo"

    @classmethod
    def from_config(cls, config, group=None) -> SlabHalo:
        return cls(SlabPlanner.from_config(config, group))


class SlabHaloPlugin:
    @hookimpl
    def mlipdd_register_strategies(self, register):
        register(SlabHalo.name, SlabHalo, "halo storage on slabs (test)")


def register() -> None:
    if SlabHalo.name not in plugins.registry().strategies:
        plugins.register_plugin(SlabHaloPlugin(), PLUGIN)


@pytest.fixture
def slab_halo():
    register()
    yield
    plugins.unregister_plugin(PLUGIN)


class SlabReadyMPNN(ToyMPNN):
    """A plugin's wrapper with two specs, choosing by what the strategy accepts."""

    def distribution_spec(self, strategy=None):
        return fitting_spec(strategy, (lambda: SPEC_MPNN_SHARDED, lambda: SPEC_MPNN_HALO), "SlabReadyMPNN")


def model():
    torch.manual_seed(0)
    return SlabReadyMPNN(cutoff=4.0, layers=2, species=(18,))


def system():
    return long_triclinic(reps=(9, 3, 3))  # widest along a: the slabs cut a


def test_the_spec_chooser_asks_the_strategy(slab_halo):
    assert model().distribution_spec("slab_halo") is SPEC_MPNN_HALO  # SlabHalo refuses sharded
    assert model().distribution_spec("sharded") is SPEC_MPNN_SHARDED
    with pytest.raises(SpecError, match="no spec for the 'graph_partition' strategy.*halo, sharded, slab_halo"):
        model().distribution_spec("graph_partition")


def _forces_worker(rank, world_size, batch):
    register()  # a fresh process: the plugin is registered here too
    dm = DistributedModel(model(), DomainConfig(cutoff=4.0, strategy=SlabHalo.name))
    owned = dm.partition(batch if rank == 0 else None)
    out = dm(owned, compute_stress=True)
    return {"atom_ids": owned.atom_ids, "report": dm.strategy.report(),
            **{k: out[k].detach() for k in ("energy", "forces", "stress")}}


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_a_third_party_strategy_equals_one_process(world_size):
    batch = system()
    reference = model()(batch.clone(), compute_stress=True)
    parts = run_ranks(_forces_worker, world_size, batch)
    forces = gather_by_id(parts, "forces", batch.num_atoms)
    for key, value in (("energy", parts[-1]["energy"]), ("forces", forces), ("stress", parts[0]["stress"])):
        assert relative_difference(value, reference[key].detach()) <= 1e-10, key
    for p in parts:
        report = p["report"]
        assert report["strategy"] == "slab_halo" and report["grid"] == (world_size, 1, 1), report
        assert report["ghost_rows"] > 0 and report["rebuilds"] == 1, report


def _md(batch, n_steps, world_size=None, rank=0):
    """NVE from the same velocities: one process, or ``world_size`` ranks of SlabHalo."""
    initialize_velocities(batch, 300.0, seed=3)
    dynamics = NVE(model(), dt=2.0)
    if world_size is None:
        dynamics.run(batch, n_steps)
        return batch
    register()
    with DomainParallel(dynamics, DomainConfig(cutoff=4.0, skin=0.3, strategy=SlabHalo.name)) as dp:
        dp.partition(batch if rank == 0 else None)
        dp.run(n_steps)
        report = dp.strategy.report()
        return dp.gather(), report


def _md_worker(rank, world_size, batch, n_steps):
    full, report = _md(batch, n_steps, world_size, rank)
    return full, report


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_a_third_party_strategy_runs_md_like_one_process(world_size):
    n_steps = 30
    reference = _md(system(), n_steps)
    (full, report), *_ = run_ranks(_md_worker, world_size, system(), n_steps)
    assert report["rebuilds"] > 1, "no atom moved far enough to migrate: nothing tested"
    order = torch.argsort(reference.atom_ids)
    assert torch.equal(full.atom_ids, reference.atom_ids[order])
    assert (unwrapped_positions(full) - unwrapped_positions(reference)[order]).abs().max() < 1e-9


@dataclass(frozen=True)
class MirrorPolicy(HaloStoragePolicy):
    """A third party's storage policy kind (halo storage under another name)."""

    kind = "mirror"


@dataclass(frozen=True)
class ComposingMirrorPolicy(MirrorPolicy):
    def merge_with(self, other):
        return self if other.is_halo() or other.is_local() else None


def test_a_new_policy_kind_merges_by_its_own_rule_or_is_refused_by_name():
    with pytest.raises(SpecError, match="no rule composes MirrorPolicy \\(kind 'mirror'\\).*define merge_with"):
        merge_policies(MirrorPolicy(), HaloStoragePolicy())
    mirror = ComposingMirrorPolicy()
    assert merge_policies(HaloStoragePolicy(), mirror) is mirror
    with pytest.raises(SpecError, match="no rule composes"):
        merge_policies(mirror, SPEC_MPNN_SHARDED.distribution.policy)
