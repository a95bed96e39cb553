"""Strategies are an extension point: an abstract base class, a registry filled by a hook.

A third-party strategy, registered from an in-process plugin, runs through
`DistributedModel` on real gloo ranks and equals one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mlipdd import plugins
from mlipdd.data import Batch, InputError
from mlipdd.distributed import DistributedModel, DomainConfig, StrategyKind
from mlipdd.hookspecs import hookimpl
from mlipdd.strategy import (
    GraphPartitionStrategy,
    HaloStrategy,
    ShardedStrategy,
    Strategy,
)
from mlipdd.strategy.outputs import consolidate_outputs
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import gather_by_id, relative_difference
from mlipdd.testing.systems import triclinic
from mlipdd.testing.toy_models import ToyMPNN

PLUGIN = "third_party_strategy"


class EveryRankWhole(Strategy):
    """Every rank evaluates the whole system and owns the atoms with id % world_size == rank.

    No speed-up at all, but a complete strategy: ownership, a collective prepare, a
    batch for the model and consolidation to owned rows, through the public API only.
    """

    name = "every_rank_whole"

    def __init__(self, group=None):
        self.group = group
        self.static: Batch | None = None
        self.positions: torch.Tensor | None = None

    @classmethod
    def from_config(cls, config, group=None) -> EveryRankWhole:
        return cls(group)

    @classmethod
    def accepts(cls, policy) -> bool:
        return policy.is_local() or policy.is_halo()

    def partition(self, full, device=None) -> Batch:
        box = [full.clone() if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=self.group)
        self.static = box[0]
        return self.static.select_atoms(self.static.atom_ids % self.world_size == self.rank)

    def prepare(self, batch: Batch, rebuild: bool) -> None:
        """Collective, every forward (nothing to rebuild): every rank's owned positions ->
        the whole system's, by atom id."""
        parts = [None] * self.world_size
        mine = (batch.atom_ids, batch.positions.detach())
        if self.world_size > 1:
            dist.all_gather_object(parts, mine, group=self.group)
        else:
            parts = [mine]
        positions = torch.empty_like(self.static.positions)
        for ids, rows in parts:
            positions[ids] = rows
        self.positions = positions

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, int]:
        """Every rank holds every row, plain: nothing crosses ranks in the forward."""
        whole = self.static.clone()
        whole.node["positions"] = self.positions
        self.owned_ids = batch.atom_ids
        return whole, whole.num_atoms

    def consolidate(self, outputs: dict, n_rows: int, spec, autograd_outputs) -> dict:
        def per_atom(name, value):
            return value[self.owned_ids] if value.dim() and value.shape[0] == n_rows else value

        return consolidate_outputs(outputs, spec.replace(all_reduce_outputs=frozenset()), self.group, per_atom)


class ThirdPartyPlugin:
    @hookimpl
    def mlipdd_register_strategies(self, register):
        register(EveryRankWhole.name, EveryRankWhole, "whole system on every rank (test)")


@pytest.fixture
def third_party():
    plugins.register_plugin(ThirdPartyPlugin(), PLUGIN)
    yield
    plugins.unregister_plugin(PLUGIN)


def test_builtin_strategies_register_through_the_builtin_plugin():
    reg = plugins.registry()
    expected = {"halo": HaloStrategy, "sharded": ShardedStrategy, "graph_partition": GraphPartitionStrategy}
    for name, cls in expected.items():
        assert reg.strategies[name].cls is cls and reg.strategies[name].plugin == "builtin"
        assert plugins.get_strategy(StrategyKind(name).value) is cls


def test_strategy_is_an_abstract_base_class():
    class Incomplete(Strategy):
        @classmethod
        def from_config(cls, config, group=None):
            return cls()

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


def test_unknown_strategy_name_is_refused_with_the_fix():
    with pytest.raises(InputError, match="not a registered strategy.*mlipdd_register_strategies"):
        DomainConfig(cutoff=4.0, strategy=EveryRankWhole.name)


class _Bad:
    def __init__(self, name, cls):
        self.name, self.cls = name, cls

    @hookimpl
    def mlipdd_register_strategies(self, register):
        register(self.name, self.cls)


@pytest.mark.parametrize(
    ("name", "cls", "error", "message"),
    [
        ("mine", object, plugins.PluginError, "not a subclass of mlipdd.strategy.Strategy"),
    ],
)
def test_the_core_owns_registration_errors(name, cls, error, message):
    plugins.register_plugin(_Bad(name, cls), "bad")
    try:
        with pytest.raises(error, match=message):
            plugins.registry()
    finally:
        plugins.unregister_plugin("bad")


def test_a_plugin_claiming_a_core_strategy_name_is_disabled():
    plugins.register_plugin(_Bad("halo", EveryRankWhole), "bad")
    try:
        with pytest.warns(RuntimeWarning, match="'halo'.*'builtin' and plugin 'bad'"):
            reg = plugins.registry()
        assert reg.strategies["halo"].plugin == "builtin"
    finally:
        plugins.unregister_plugin("bad")


def _third_party_worker(rank, world_size, batch):
    plugins.register_plugin(ThirdPartyPlugin(), PLUGIN)  # a fresh process: register here too
    model = ToyMPNN(cutoff=4.0, layers=2, species=(18,))
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, strategy=EveryRankWhole.name))
    owned = dm.partition(batch if rank == 0 else None)
    out = dm(owned, compute_stress=True)
    return {"atom_ids": owned.atom_ids, "strategy": type(dm.strategy).__name__,
            **{k: out[k] for k in ("energy", "forces", "stress")}}


def test_third_party_strategy_runs_through_distributed_model(third_party):
    assert DomainConfig(cutoff=4.0, strategy=EveryRankWhole.name).strategy_name == EveryRankWhole.name
    batch = triclinic(reps=4)
    reference = ToyMPNN(cutoff=4.0, layers=2, species=(18,))(batch.clone(), compute_stress=True)
    parts = run_ranks(_third_party_worker, 2, batch)
    assert {p["strategy"] for p in parts} == {"EveryRankWhole"}
    assert sum(p["atom_ids"].numel() for p in parts) == batch.num_atoms
    forces = gather_by_id(parts, "forces", batch.num_atoms)
    for key, value in (("energy", parts[1]["energy"]), ("forces", forces), ("stress", parts[0]["stress"])):
        assert relative_difference(value, reference[key].detach()) <= 1e-12, key


def test_the_default_strategy_is_the_models_preference_on_several_ranks():
    """DomainConfig(strategy=None): the model's preferred_strategy with its own spec on
    several ranks; halo at one rank, with an explicit spec, and for models without one."""
    from mlipdd.distributed.config import DomainConfig, resolve_strategy
    from mlipdd.models.lj import LennardJones
    lj = LennardJones(epsilon=0.0104, sigma=3.4, cutoff=7.0)
    config = DomainConfig(cutoff=7.0)
    assert config.strategy is None and config.strategy_name == "auto"
    assert resolve_strategy(config, lj, 2, own_spec=True).strategy == "halo"
    lj.preferred_strategy = "sharded"
    assert resolve_strategy(config, lj, 2, own_spec=True).strategy == "sharded"
    assert resolve_strategy(config, lj, 1, own_spec=True).strategy == "halo"
    assert resolve_strategy(config, lj, 2, own_spec=False).strategy == "halo"
    given = DomainConfig(cutoff=7.0, strategy="graph_partition")
    assert resolve_strategy(given, lj, 2, own_spec=True) is given
