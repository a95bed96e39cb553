"""A run that blows up stops with one message naming the step and the time step, before
the bad frame is written, on every rank together (catalogue entries B1, B2).

A hot LJ fluid at dt = 25 fs runs normally for ~70 steps, then atoms collide too hard;
at dt = 200 fs (the reported case) the very first step would move atoms by more than an
Angstrom.
"""

from __future__ import annotations

import re

import ase.io
import numpy as np
import pytest
from mlipdd.distributed import DomainConfig, DomainParallel
from mlipdd.dynamics import NVE, TrajectoryWriter
from mlipdd.dynamics.base import BlowUpError
from mlipdd.lattices import lj_liquid
from mlipdd.models.lj import LennardJones
from mlipdd.testing import run_ranks

CUTOFF = 5.5


def _integrator(dt, hooks=()):
    return NVE(LennardJones(epsilon=0.0104, sigma=3.4, cutoff=CUTOFF), dt, hooks)


def _system():
    return lj_liquid(3, temperature=1500.0, seed=5)


def _blown_step(message: str) -> int:
    return int(re.search(r"at step (\d+)", message).group(1))


def _assert_frames_sane(path, before_step):
    frames = ase.io.read(path, ":")
    assert frames, "the frames before the blow-up are kept"
    assert max(f.info["step"] for f in frames) < before_step  # the bad frame is not written
    cell = frames[0].cell.lengths().max()
    for frame in frames:
        assert np.isfinite(frame.positions).all() and np.abs(frame.positions).max() < 3 * cell


def test_blow_up_in_one_process_names_the_step_and_the_time_step(tmp_path):
    path = tmp_path / "md.extxyz"
    with pytest.raises(BlowUpError, match=r"time step \(25 fs\)") as info:
        _integrator(25.0, [TrajectoryWriter(path, frequency=1)]).run(_system(), 200)
    step = _blown_step(str(info.value))
    assert step > 10  # it ran normally first: the frames before it are worth keeping
    _assert_frames_sane(path, step)


def _blow_up_on_ranks(rank, world_size, path):
    with DomainParallel(
        _integrator(25.0), DomainConfig(cutoff=CUTOFF), 200, [TrajectoryWriter(path, frequency=1)]
    ) as dp:
        dp.partition(_system() if rank == 0 else None)
        try:
            dp.run()
        except BlowUpError as exc:  # this very class on every rank, not a RemoteRankError
            return str(exc)
    return None


def test_blow_up_under_dd_stops_every_rank_with_the_same_message(tmp_path):
    path = tmp_path / "md.extxyz"
    messages = run_ranks(_blow_up_on_ranks, 2, str(path), timeout=180)
    assert messages[0] is not None and messages == [messages[0]] * 2
    assert "time step (25 fs)" in messages[0]
    _assert_frames_sane(path, _blown_step(messages[0]))


def test_the_reported_200_fs_run_stops_before_any_frame(tmp_path):
    path = tmp_path / "md.extxyz"
    with pytest.raises(BlowUpError, match=r"at step 0 .* time step \(200 fs\)"):
        _integrator(200.0, [TrajectoryWriter(path, frequency=1)]).run(_system(), 20)
    assert not path.exists()
