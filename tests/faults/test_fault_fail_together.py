"""One rank fails inside the force backward: every rank raises that rank's error within
seconds (catalogue entries F1, F2). The NCCL run of the same case is
``gpu_fail_together.py`` in this folder (device machine; results in
benchmarks/results/gpu_checks.md).
"""

from __future__ import annotations

import time

import pytest
from mlipdd.distributed import DomainConfig, DomainParallel
from mlipdd.dynamics import NVE
from mlipdd.lattices import lj_liquid
from mlipdd.testing import RankFailure, run_ranks
from mlipdd.testing.faults import FailsInBackward, fault_message

FAIL_CALL = 4  # the setup's force call, then three steps


def fail_in_backward(rank, world_size, fail_rank, kind, device="cpu"):
    """Runs on every rank; returns nothing: the run must end in an exception everywhere.
    Each rank writes how long after the start it raised into the exception's message."""
    model = FailsInBackward(fail_rank, FAIL_CALL, kind).to(device)
    start = time.perf_counter()
    try:
        with DomainParallel(NVE(model, 2.0), DomainConfig(cutoff=model.cutoff), 50) as dp:
            dp.partition(lj_liquid(4, temperature=300.0, seed=1).to(device) if rank == 0 else None)
            dp.run()
    except Exception as exc:
        raise type(exc)(f"{exc} [raised after {time.perf_counter() - start:.1f} s]") from exc


@pytest.mark.parametrize(("fail_rank", "kind"), [(1, "raise"), (0, "oom")])
def test_a_failure_in_the_backward_is_raised_on_every_rank(fail_rank, kind):
    """F1 (rank 1 raises), F2 (rank 0, which hosts the store, runs out of memory)."""
    start = time.perf_counter()
    with pytest.raises(RankFailure) as info:
        run_ranks(fail_in_backward, 3, fail_rank, kind, timeout=120)
    assert time.perf_counter() - start < 60  # seconds, never the collective timeout
    failures = info.value.failures
    assert sorted(failures) == [0, 1, 2]
    # the allocator's words for an out-of-memory error, else the injected message
    message = "allocate" if kind == "oom" else fault_message(fail_rank, FAIL_CALL)
    for rank, text in failures.items():
        last = text.strip().splitlines()[-1]
        assert message in last, last
        if rank == fail_rank:
            assert "RemoteRankError" not in last
        else:  # the failing rank's own error, by name and rank
            assert "RemoteRankError" in last and f"rank {fail_rank} failed" in last, last
