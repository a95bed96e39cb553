"""Langevin MD of MACE under `DomainParallel` on 2 and 4 spawned ranks (halo storage) and
3 ranks (sharded storage) equals one process.

A random-weight MACE (float64, two interaction layers, H/C/O) drives a hot, skewed
periodic cell of 27 atoms for 40 BAOAB steps. The Verlet skin is small and the light
H atoms move fast, so halos are rebuilt many times and atoms change owner. The
Langevin noise is keyed by (seed, step, atom id), so the distributed and the single
process trajectories are the same trajectory, not just statistically alike.

Tolerance on positions and velocities (by atom id, positions unwrapped): 1e-10. The
forces of a distributed step differ from one process only in summation order (ghost
partial sums added on their owner), about 1e-15 relative; MD amplifies that, but 40
steps are too short for chaos to grow it much. Measured here: max 8.9e-16 A at 2, 3 and 4
ranks (grids 1x1x2, 1x1x3, 2x1x2), 13 rebuilds, 2 / 3 / 3 owner changes (printed with
``pytest -s``; 100 steps, the length before session 16, gave 8.9e-15 A, 28 rebuilds and
7-12 owner changes for 2.5x the time). 1e-10 leaves five orders of magnitude for other
machines and BLAS builds, and stays sensitive: a force error dF held for the 20 fs of the
run moves an H atom by about 2 dF (A per eV/A), so errors down to ~5e-11 eV/A would be
caught; a missing ghost or a lost edge is many orders of magnitude larger than that.

One model is built in the test process and handed to the ranks: a MACE build is ~2 s of
e3nn code generation in every process that builds one.
"""

from __future__ import annotations

import functools
import io

import pytest
import torch

from mlipdd.distributed import DomainConfig, DomainParallel, HookScope, unwrapped_positions
from mlipdd.dynamics import DynamicsStage, NVTLangevin, ThermoLogger, initialize_velocities
from mlipdd.testing import run_ranks
from mlipdd.testing.systems import triclinic
from mlipdd_mace.testing import random_mace_wrapper

SPECIES = (1, 6, 8)
R_MAX = 4.0
FACTORY = functools.partial(
    random_mace_wrapper,
    elements=SPECIES,
    r_max=R_MAX,
    num_interactions=2,
    dtype=torch.float64,
    seed=0,
)
N_STEPS = 40
FRAME_EVERY = 10
DT_FS = 0.5
TEMPERATURE = 1000.0
SKIN = 0.3
POSITION_TOL = 1e-10  # A; see the module docstring for the measured size of the noise


def starting_system():
    """27 atoms of H, C and O on a rattled grid in a triclinic cell (angles ~60-70 deg)."""
    batch = triclinic(species=SPECIES, spacing=2.3, reps=3)
    return initialize_velocities(batch, TEMPERATURE, seed=1)


@functools.cache
def built_model():
    return FACTORY()


def langevin(model, hooks=()):
    return NVTLangevin(model, DT_FS, TEMPERATURE, friction=0.02, seed=5, hooks=hooks)


class Frames:
    """Unwrapped positions and velocities in atom-id order every ``frequency`` steps."""

    stage = (DynamicsStage.BEFORE_RUN, DynamicsStage.AFTER_STEP)
    scope = HookScope.RANK_ZERO

    def __init__(self, frequency: int = FRAME_EVERY):
        self.frequency = frequency
        self.frames: dict[int, dict] = {}

    def __call__(self, ctx, stage):
        batch = ctx.batch
        order = torch.argsort(batch.atom_ids)
        self.frames[ctx.step] = {
            "ids": batch.atom_ids[order].clone(),
            "positions": unwrapped_positions(batch)[order].clone(),
            "velocities": batch.velocities[order].clone(),
            "energy": batch.energy.clone(),
        }


class Owners:
    """The atom ids this rank owns after every step (LOCAL: the owned batch)."""

    stage = (DynamicsStage.BEFORE_RUN, DynamicsStage.AFTER_STEP)
    frequency = 1
    scope = HookScope.LOCAL

    def __init__(self):
        self.history: list[torch.Tensor] = []

    def __call__(self, ctx, stage):
        self.history.append(ctx.batch.atom_ids.clone())


def owner_changes(histories: list[list[torch.Tensor]]) -> int:
    """How many times, over the run, an atom moved to another rank."""
    changes, before = 0, None
    for step in range(len(histories[0])):
        owner = {int(i): r for r, history in enumerate(histories) for i in history[step]}
        if before is not None:
            changes += sum(owner[a] != before[a] for a in owner)
        before = owner
    return changes


def _distributed_run(rank, world_size, strategy, model):
    frames, owners = Frames(), Owners()
    # RANK_ZERO thermo log: Langevin's conserved energy (bath ledger) on the gathered view
    thermo = ThermoLogger(io.StringIO(), frequency=FRAME_EVERY)
    config = DomainConfig(cutoff=R_MAX, skin=SKIN, strategy=strategy)
    hooks = [frames, owners, (thermo, HookScope.RANK_ZERO)]
    with DomainParallel(langevin(model), config, N_STEPS, hooks=hooks) as dp:
        dp.partition(starting_system() if rank == 0 else None)
        dp.run()
        return {
            "frames": frames.frames,
            "owners": owners.history,
            "rebuilds": dp.strategy.rebuilds,
            "grid": tuple(dp.strategy.grid.dims),
            "owned_ids": dp.batch.atom_ids.clone(),
            "thermo": thermo.records,
        }


@functools.cache
def single_process_run() -> tuple[dict, list[dict]]:
    frames, thermo = Frames(), ThermoLogger(io.StringIO(), frequency=FRAME_EVERY)
    batch = starting_system()
    langevin(built_model(), [frames, thermo]).run(batch, N_STEPS)
    return frames.frames, thermo.records


@pytest.mark.parametrize(("strategy", "world_size"), [("halo", 2), ("halo", 4), ("sharded", 3)])
def test_langevin_trajectory_equals_one_process(strategy, world_size):
    results = run_ranks(_distributed_run, world_size, strategy, built_model(), timeout=600)
    expected, expected_thermo = single_process_run()
    frames = results[0]["frames"]
    assert sorted(frames) == sorted(expected) == list(range(0, N_STEPS + 1, FRAME_EVERY))
    worst = 0.0
    for step, ref in expected.items():
        assert torch.equal(frames[step]["ids"], ref["ids"]), f"atom ids differ at step {step}"
        diff = float((frames[step]["positions"] - ref["positions"]).abs().max())
        worst = max(worst, diff)
        assert diff < POSITION_TOL, f"step {step}: positions differ by {diff:.3g} A"
        vdiff = float((frames[step]["velocities"] - ref["velocities"]).abs().max())
        assert vdiff < POSITION_TOL, f"step {step}: velocities differ by {vdiff:.3g}"
        assert abs(float(frames[step]["energy"][0] - ref["energy"][0])) < 1e-10 * abs(
            float(ref["energy"][0])
        )
    print(f"\n{world_size} ranks, grid {results[0]['grid']}: max position difference {worst:.2e} A")
    # the atoms really travelled: they are not where they started
    moved = float((expected[N_STEPS]["positions"] - expected[0]["positions"]).norm(dim=1).max())
    assert moved > 2 * SKIN
    # halos were rebuilt and atoms changed owner (migration is part of what is checked)
    changes = owner_changes([r["owners"] for r in results])
    rebuilds = min(r["rebuilds"] for r in results)
    print(f"{world_size} ranks: {rebuilds} rebuilds, {changes} owner changes")
    assert rebuilds > 3 and changes > 0
    # the thermo log (rank 0 only) has the single-process numbers, conserved energy included
    assert [r["thermo"] for r in results[1:]] == [[]] * (world_size - 1)
    logged = results[0]["thermo"]
    assert [row["step"] for row in logged] == [row["step"] for row in expected_thermo]
    for row, ref in zip(logged, expected_thermo):
        for key in ("epot", "ekin", "econs", "temperature"):
            assert abs(row[key] - ref[key]) <= 1e-10 * max(1.0, abs(ref[key])), (key, row, ref)
    ids = torch.sort(torch.cat([r["owned_ids"] for r in results])).values
    assert torch.equal(ids, torch.arange(starting_system().num_atoms)), "atoms lost or duplicated"
