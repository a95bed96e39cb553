"""Trajectory files hold unwrapped positions at every rank count (catalogue entry O1).

Ranks wrap atoms into the cell when they migrate; one process never does. The file a
rank-zero `TrajectoryWriter` writes must not show it: a 1-, 2- and 3-rank run of a hot
LJ fluid whose atoms cross the periodic boundary write the same extxyz file.
"""

from __future__ import annotations

import ase.io
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
