"""The test launcher (mlipdd.testing.spawn) when ranks cannot form their process group."""

from __future__ import annotations

import time

import pytest
from mlipdd.testing.spawn import _NOT_JOINED, RankFailure, run_ranks


def _never_called(rank, world_size):
    raise AssertionError("fn must not run without a process group")


def test_a_group_that_cannot_form_is_reported_at_once_and_relaunched():
    """A rank that fails to join (here: a backend torch does not know) ends the launch at
    once, named as a join failure, instead of its peers waiting out the timeout; the launcher
    tries fresh ports twice more, then raises."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        run_ranks(_never_called, 2, backend="no_such_backend", timeout=120)
    assert time.monotonic() - start < 60
    messages = list(caught.value.failures.values())
    assert messages and all(m.startswith(_NOT_JOINED) for m in messages), messages
    assert "no_such_backend" in messages[0].lower() or "backend" in messages[0].lower()
