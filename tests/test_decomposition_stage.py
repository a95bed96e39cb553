"""The decomposition stage of DomainParallel's MD step (NOTE [decomposition stage] in
mlipdd.distributed.model): inputs checked and the rebuild voted in ONE all-reduce per
step, migration and planning before the force call, never inside it."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from mlipdd.distributed import DomainConfig, DomainParallel
from mlipdd.dynamics import NVE, DynamicsStage
from mlipdd.lattices import lj_liquid
from mlipdd.models.lj import LennardJones
from mlipdd.testing import run_ranks


class OwnedAtBeforeCompute:
    """Records, at BEFORE_COMPUTE (after the stage), how many owned atoms are outside this
    rank's subdomain: none after a rebuild, because the stage migrated them before the
    other hooks and the force call run (between rebuilds an atom may stray by skin / 2)."""

    stage = DynamicsStage.BEFORE_COMPUTE
    frequency = 1

    def __init__(self, strategy):
        self.strategy, self.outside = strategy, []

    def __call__(self, ctx, stage):
        halo = self.strategy.halo
        self.outside.append(int((halo.owners(ctx.batch) != halo.rank).sum()))


def _worker(rank, world_size, n_steps):
    lj = LennardJones(epsilon=0.0104, sigma=3.4, cutoff=6.0)
    # check_every=1: finite positions are checked at every step too, still in the one vote
    config = DomainConfig(cutoff=6.0, skin=0.3, check_every=1)
    with DomainParallel(NVE(lj, 5.0), config) as dp:
        dp.partition(lj_liquid(3, temperature=600.0, seed=2) if rank == 0 else None)
        dm, strategy = dp.model, dp.strategy
        calls = []  # per decomposition stage: (all-reduces in it, rebuilt)
        unprepared_forwards = []
        real_prepare, real_forward, real_all_reduce = dm._prepare, dm.forward, dist.all_reduce

        def counting_all_reduce(*args, **kwargs):
            counting_all_reduce.n += 1
            return real_all_reduce(*args, **kwargs)

        def prepare(batch):
            counting_all_reduce.n, before = 0, strategy.rebuilds
            dist.all_reduce = counting_all_reduce
            try:
                real_prepare(batch)
            finally:
                dist.all_reduce = real_all_reduce
            calls.append((counting_all_reduce.n, strategy.rebuilds != before))

        def forward(batch, compute_stress=False):
            unprepared_forwards.append(not dm._prepared_for(batch))
            return real_forward(batch, compute_stress)

        dm._prepare, dm.forward = prepare, forward
        hook = OwnedAtBeforeCompute(strategy)
        dp.dynamics.add_hook(hook)
        dp.run(n_steps)
        return {"calls": calls, "unprepared": unprepared_forwards, "outside": hook.outside}


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_one_vote_per_step_and_migration_before_the_force_call(world_size):
    n_steps = 40
    for part in run_ranks(_worker, world_size, n_steps):
        calls = part["calls"]
        assert len(calls) == n_steps + 1  # the first force evaluation, then one per step
        assert not any(part["unprepared"]), "a force call had to plan for itself"
        assert all(n == 1 for n, rebuilt in calls if not rebuilt), calls
        assert sum(rebuilt for _, rebuilt in calls) > 2, "no rebuild: migration not exercised"
        after_rebuild = [out for out, (_, rebuilt) in zip(part["outside"], calls, strict=True) if rebuilt]
        assert after_rebuild == [0] * len(after_rebuild), "owned atoms outside the subdomain after a rebuild"
        assert any(part["outside"]), "no atom ever strayed: migration not exercised"


class NaNOnRankOne:
    """At AFTER_POSITIONS of step 2, one position of rank 1 becomes NaN (as a blow-up
    between two force calls would make it)."""

    stage = DynamicsStage.AFTER_POSITIONS
    frequency = 1

    def __call__(self, ctx, stage):
        if ctx.step == 2 and dist.get_rank() == 1 and ctx.batch.num_atoms:
            ctx.batch.positions[0, 1] = float("nan")


def _nan_worker(rank, world_size):
    lj = LennardJones(epsilon=0.0104, sigma=3.4, cutoff=6.0)
    dynamics = NVE(lj, 5.0, hooks=[NaNOnRankOne()])
    with DomainParallel(dynamics, DomainConfig(cutoff=6.0, check_every=1)) as dp:
        dp.partition(lj_liquid(3, temperature=100.0, seed=2) if rank == 0 else None)
        try:
            dp.run(5)
        except Exception as exc:  # noqa: BLE001 - the message is the result
            return type(exc).__name__, str(exc), dp.step_count
        return None


def test_a_nan_position_on_one_rank_stops_every_rank_at_the_stage():
    outcomes = run_ranks(_nan_worker, 2)
    assert None not in outcomes, outcomes
    for kind, message, steps in outcomes:  # agreed at the stage of step 3: same words, group intact
        assert kind in ("InputError", "DistributedInputError"), outcomes
        assert "positions contain NaN or inf" in message and "lower the time step" in message, outcomes
        assert steps == 2, outcomes
