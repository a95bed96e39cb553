"""A stop request (what SIGTERM becomes) ends the run after a whole step, on every rank alike.

Catalogue entry L6 (see README.md in this folder).
"""

from __future__ import annotations

import pytest
import torch
from mlipdd.distributed.checkpoint import CheckpointWriter, load_checkpoint
from mlipdd.dynamics import NVE, DynamicsStage, RunStopped
from mlipdd.dynamics import stop as stop_requests
from mlipdd.testing.spawn import run_ranks


class RequestStopAt:
    """Asks for a stop at one step on some ranks, as a signal handler would."""

    stage = DynamicsStage.AFTER_STEP
    frequency = 1
    scope = "local"

    def __init__(self, step: int, ranks=(0,)):
        self.step, self.ranks = step, ranks

    def __call__(self, ctx, stage) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if ctx.step == self.step and rank in self.ranks:
            stop_requests.request_stop("test request")


def _argon():
    from mlipdd.app.simulation import RunConfig, build_model, build_system

    cfg = RunConfig(size=3, device="cpu", ensemble="nve")
    return build_model(cfg), build_system(cfg)


def test_one_process_stops_after_the_step_and_writes_the_checkpoint(tmp_path):
    model, batch = _argon()
    writer = CheckpointWriter(tmp_path / "state.pt", frequency=1000)
    dyn = NVE(model, 2.0, [RequestStopAt(3), writer])
    stop_requests.clear()
    with stop_requests.watch_requests(), pytest.raises(RunStopped) as info:
        dyn.run(batch, 50)
    stop_requests.clear()
    assert info.value.step == 3 and dyn.step_count == 3
    assert load_checkpoint(tmp_path / "state.pt").step == 3
    assert info.value.exit_code == 143


def _stop_on_rank_one(rank, world_size, path):
    from mlipdd.distributed import DomainConfig, DomainParallel

    model, full = _argon()
    dyn = NVE(model, 2.0)
    stop_requests.clear()
    hooks = [RequestStopAt(4, ranks=(1,)), CheckpointWriter(path, frequency=1000)]
    with DomainParallel(dyn, DomainConfig(cutoff=model.cutoff), 50, hooks) as dp:
        dp.partition(full if rank == 0 else None)
        with stop_requests.watch_requests():
            try:
                dp.run()
            except RunStopped as stopped:
                return stopped.step, stopped.reason
    return None


def test_a_request_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    path = tmp_path / "state.pt"
    results = run_ranks(_stop_on_rank_one, 3, str(path))
    assert [r[0] for r in results] == [4, 4, 4]
    assert results[1][1] == "test request"  # the others learn it came from elsewhere
    assert results[0][1] == "a stop was requested on another rank"
    assert load_checkpoint(path).step == 4
