"""Trajectory files hold unwrapped positions, energies and forces at every rank count (O1, O2).

Ranks wrap atoms into the cell when they migrate; one process never does. The file a
rank-zero `TrajectoryWriter` writes must not show it: a 1-, 2- and 3-rank run of a hot
LJ fluid whose atoms cross the periodic boundary write the same extxyz file.
"""

from __future__ import annotations

import ase.io
import numpy as np
import pytest
from mlipdd.distributed import DomainConfig, DomainParallel, load_checkpoint
from mlipdd.distributed.checkpoint import CheckpointWriter
from mlipdd.dynamics import NVE, TrajectoryWriter
from mlipdd.lattices import lj_liquid
from mlipdd.models.lj import LennardJones
from mlipdd.testing import run_ranks

STEPS, EVERY, CUTOFF = 40, 10, 5.5


def _integrator(hooks=()):
    return NVE(LennardJones(epsilon=0.0104, sigma=3.4, cutoff=CUTOFF), 2.0, hooks)


def _system():
    return lj_liquid(3, temperature=1500.0, seed=5)  # 108 atoms, 1500 K: many crossings


def _write_on_ranks(rank, world_size, path, checkpoint):
    hooks = [TrajectoryWriter(path, frequency=EVERY), CheckpointWriter(checkpoint, frequency=STEPS)]
    with DomainParallel(_integrator(), DomainConfig(cutoff=CUTOFF), STEPS, hooks) as dp:
        dp.partition(_system() if rank == 0 else None)
        dp.run()


def test_trajectory_files_are_equal_at_one_two_and_three_ranks(tmp_path):
    one = tmp_path / "one.extxyz"
    _integrator([TrajectoryWriter(one, frequency=EVERY)]).run(_system(), STEPS)
    files = {1: one}
    for world in (2, 3):
        files[world] = tmp_path / f"ranks{world}.extxyz"
        checkpoint = tmp_path / f"ranks{world}.pt"
        run_ranks(_write_on_ranks, world, str(files[world]), str(checkpoint), timeout=180)
        # the ranks did wrap atoms: otherwise this test would prove nothing
        assert int(load_checkpoint(checkpoint).batch.image.abs().sum()) > 0

    reference = ase.io.read(one, ":")
    assert len(reference) == STEPS // EVERY + 1
    for world in (2, 3):
        _assert_same_file(files[world], one, f"{world} ranks")


def _assert_same_file(path, reference, label, tol=1e-8):
    """Equal text, token by token, except numbers in the last printed digit: the energy
    (full precision) and forces near zero (the sign of -0.00000000) depend on the order
    of summation; a wrapped atom is off by a cell length."""
    lines, expected = path.read_text().splitlines(), reference.read_text().splitlines()
    assert len(lines) == len(expected), f"{label}: {len(lines)} lines, one process {len(expected)}"
    for number, (line, ref) in enumerate(zip(lines, expected, strict=True)):
        tokens, ref_tokens = _tokens(line), _tokens(ref)
        assert len(tokens) == len(ref_tokens), f"{label}, line {number}: {line!r} vs {ref!r}"
        for a, b in zip(tokens, ref_tokens, strict=True):
            if isinstance(b, float):
                assert abs(a - b) <= tol + 1e-12 * abs(b), (
                    f"{label}, line {number}: {line!r} vs {ref!r}"
                )
            else:
                assert a == b, f"{label}, line {number}: {line!r} vs {ref!r}"


def _tokens(line):
    out = []
    for token in line.replace("=", " = ").replace('"', " ").split():
        try:
            out.append(float(token))
        except ValueError:
            out.append(token)
    return out


def _write_traj_on_ranks(rank, world_size, path):
    hooks = [TrajectoryWriter(path, frequency=EVERY)]
    with DomainParallel(_integrator(), DomainConfig(cutoff=CUTOFF), STEPS, hooks) as dp:
        dp.partition(_system() if rank == 0 else None)
        dp.run()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_traj_frame_carries_energy_and_forces_at_any_rank_count(tmp_path, world_size):
    """O2 (*was broken*: at 2 ranks 1 of 5 .traj frames had them): ASE's .traj writer drops
    a single-point calculator's results once the atoms moved from where it was made, and
    the frames are moved to the unwrapped positions after it was made."""
    one = tmp_path / "one.traj"
    _integrator([TrajectoryWriter(one, frequency=EVERY)]).run(_system(), STEPS)
    ranks = tmp_path / "ranks.traj"
    run_ranks(_write_traj_on_ranks, world_size, str(ranks), timeout=180)
    reference, frames = ase.io.read(one, ":"), ase.io.read(ranks, ":")
    assert len(frames) == len(reference) == STEPS // EVERY + 1
    for ref, frame in zip(reference, frames, strict=True):
        assert frame.calc is not None and {"energy", "forces"} <= set(frame.calc.results)
        assert abs(frame.get_potential_energy() - ref.get_potential_energy()) < 1e-9
        assert np.abs(frame.get_forces() - ref.get_forces()).max() < 1e-9
        assert np.abs(frame.positions - ref.positions).max() < 1e-9  # unwrapped, as one process
