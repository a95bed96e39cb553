"""The test launcher (mlipdd.testing.spawn) when a rank hangs or dies without a word."""

from __future__ import annotations

import os
import time

import pytest
from mlipdd.testing.spawn import RankFailure, run_ranks


def _rank_one_waits_forever(rank, world_size):
    if rank == 1:
        _a_collective_its_peers_never_reach()
    return rank


def _a_collective_its_peers_never_reach():
    time.sleep(120)


def test_a_hung_rank_is_reported_with_its_stack():
    """A hang names where the rank waits (its Python stack, taken before it is killed), so a
    collective reached on some ranks only is found from the failure, not by re-running."""
    with pytest.raises(RankFailure) as caught:
        run_ranks(_rank_one_waits_forever, 2, timeout=6)
    failures = caught.value.failures
    assert sorted(failures) == [1], failures
    assert "no result within 6 s" in failures[1]
    assert "_a_collective_its_peers_never_reach" in failures[1], failures[1]


def _rank_one_dies(rank, world_size):
    if rank == 1:
        os._exit(3)  # as a segfault or the OOM killer: no traceback, no result
    return rank


def test_a_rank_that_dies_without_a_result_is_reported_at_once():
    start = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        run_ranks(_rank_one_dies, 2, timeout=120)
    assert time.monotonic() - start < 60
    assert "exited (code 3) without a result" in caught.value.failures[1]
