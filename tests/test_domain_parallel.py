"""MD under domain decomposition equals one process: NVE and Langevin, 2-4 real gloo ranks.

A hot LJ fluid (256 atoms, ~1500 K, cutoff 5.5 A) so that atoms cross every subdomain
boundary during the run; trajectories are compared by atom id on unwrapped positions.
"""

import io
import time

import pytest
import torch
from mlipdd.distributed import (
    CheckpointWriter,
    DomainConfig,
    DomainParallel,
    HookScope,
    unwrapped_positions,
)
from mlipdd.dynamics import NVE, DynamicsStage, NVTLangevin, ThermoLogger, TrajectoryWriter
from mlipdd.lattices import lj_liquid
from mlipdd.models.lj import LennardJones
from mlipdd.testing import RankFailure, run_ranks

CUTOFF = 5.5
HOT = 1500.0
DT = 2.0


def hot_liquid(size=4, seed=3):
    return lj_liquid(size, temperature=HOT, seed=seed)


def lj():
    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=CUTOFF)


def integrator(kind, hooks=()):
    if kind == "nve":
        return NVE(lj(), DT, hooks)
    return NVTLangevin(lj(), DT, HOT, friction=0.02, seed=11, hooks=hooks)


class Snapshots:
    """Unwrapped positions and total momentum by atom id every ``frequency`` steps."""

    stage = (DynamicsStage.BEFORE_RUN, DynamicsStage.AFTER_STEP)
    scope = HookScope.RANK_ZERO

    def __init__(self, frequency=50):
        self.frequency = frequency
        self.frames = {}

    def __call__(self, ctx, stage):
        b = ctx.batch
        order = torch.argsort(b.atom_ids)
        momentum = (b.atomic_masses.unsqueeze(-1) * b.velocities).sum(0)
        self.frames[ctx.step] = {
            "ids": b.atom_ids[order].clone(),
            "positions": unwrapped_positions(b)[order].clone(),
            "velocities": b.velocities[order].clone(),
            "momentum": momentum.clone(),
        }


class OwnedIds:
    """The ids this rank owns after every step (LOCAL scope: the owned atoms)."""

    stage = (DynamicsStage.BEFORE_RUN, DynamicsStage.AFTER_STEP)
    frequency = 1
    scope = HookScope.LOCAL

    def __init__(self):
        self.history = []

    def __call__(self, ctx, stage):
        self.history.append(ctx.batch.atom_ids.clone())


def crossings(histories):
    """(from rank, to rank) -> how many times an atom changed owner that way."""
    owner_before, counts = None, {}
    for step in range(len(histories[0])):
        owner = {int(i): r for r, h in enumerate(histories) for i in h[step]}
        if owner_before is not None:
            for atom, rank in owner.items():
                if owner_before[atom] != rank:
                    key = (owner_before[atom], rank)
                    counts[key] = counts.get(key, 0) + 1
        owner_before = owner
    return counts


def single_process(kind, n_steps, full=None, every=50):
    snaps = Snapshots(every)
    dyn = integrator(kind, [snaps])
    batch = (full or hot_liquid()).clone()
    dyn.run(batch, n_steps)
    return snaps.frames


def _dd_run(rank, world_size, kind, n_steps, every=50, grid=None):
    snaps, owners = Snapshots(every), OwnedIds()
    config = DomainConfig(cutoff=CUTOFF, skin=0.5, grid=grid)
    with DomainParallel(integrator(kind), config, n_steps, hooks=[snaps, owners]) as dp:
        dp.partition(hot_liquid() if rank == 0 else None)
        dp.run()
        return {
            "frames": snaps.frames,
            "owned_history": owners.history,
            "rebuilds": dp.strategy.rebuilds,
            "n_owned": dp.batch.num_atoms,
            "owned_ids": dp.batch.atom_ids.clone(),
        }


_REFERENCE = {}


def reference(kind, n_steps):
    if (kind, n_steps) not in _REFERENCE:
        _REFERENCE[kind, n_steps] = single_process(kind, n_steps)
    return _REFERENCE[kind, n_steps]


def assert_same_frames(frames, expected, tol):
    assert sorted(frames) == sorted(expected)
    for step in expected:
        assert torch.equal(frames[step]["ids"], expected[step]["ids"]), f"ids differ at step {step}"
        diff = (frames[step]["positions"] - expected[step]["positions"]).abs().max().item()
        assert diff < tol, f"step {step}: positions differ by {diff:.3g} A"


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("kind", ["nve", "nvt"])
def test_trajectory_equals_one_process(kind, world_size):
    n_steps = 200
    results = run_ranks(_dd_run, world_size, kind, n_steps, timeout=240)
    assert_same_frames(results[0]["frames"], reference(kind, n_steps), tol=1e-8)
    # atoms migrated: every rank received and sent atoms, lists were rebuilt
    moves = crossings([r["owned_history"] for r in results])
    assert {a for a, _ in moves} == {b for _, b in moves} == set(range(world_size)), moves
    assert min(r["rebuilds"] for r in results) > 2
    # atom count and ids conserved across the ranks
    ids = torch.cat([r["owned_ids"] for r in results])
    assert torch.equal(torch.sort(ids).values, torch.arange(hot_liquid().num_atoms))
    if kind == "nve":
        frames = results[0]["frames"]
        drift = max((f["momentum"] - frames[0]["momentum"]).abs().max().item() for f in frames.values())
        assert drift < 1e-10


def test_slabs_every_boundary_crossed_both_ways():
    """Slabs along x (3 ranks): atoms cross each face both ways, the periodic face too."""
    results = run_ranks(_dd_run, 3, "nve", 200, 50, (3, 1, 1), timeout=240)
    assert_same_frames(results[0]["frames"], reference("nve", 200), tol=1e-8)
    moves = crossings([r["owned_history"] for r in results])
    assert set(moves) == {(0, 1), (1, 0), (1, 2), (2, 1), (2, 0), (0, 2)}, moves


def test_without_process_group_runs_like_the_plain_integrator():
    snaps = Snapshots(25)
    with DomainParallel(integrator("nvt"), DomainConfig(cutoff=CUTOFF), 50, hooks=[snaps]) as dp:
        dp.partition(hot_liquid())
        dp.run()
        for _ in range(25):  # step() continues where run() stopped
            dp.step()
    assert_same_frames(snaps.frames, single_process("nvt", 75, every=25), tol=1e-10)


class GlobalKinetic:
    """GLOBAL scope: the whole system on every rank; its own sum must equal the reduced one."""

    stage = DynamicsStage.AFTER_STEP
    frequency = 10
    scope = HookScope.GLOBAL

    def __init__(self):
        self.values = []

    def __call__(self, ctx, stage):
        b = ctx.batch
        by_hand = 0.5 * (b.atomic_masses * (b.velocities**2).sum(-1)).sum()
        self.values.append((ctx.step, b.num_atoms, float(by_hand), float(ctx.dynamics.kinetic_energy()[0])))


def _logged_run(rank, world_size, traj_path):
    stream = io.StringIO()
    thermo, kinetic = ThermoLogger(stream, frequency=10), GlobalKinetic()
    hooks = [thermo, TrajectoryWriter(traj_path, frequency=10), kinetic]
    with DomainParallel(integrator("nve"), DomainConfig(cutoff=CUTOFF), 30, hooks=hooks) as dp:
        dp.partition(hot_liquid() if rank == 0 else None)
        dp.run()
        return {"log": stream.getvalue(), "records": thermo.records, "kinetic": kinetic.values}


def test_thermo_on_rank_zero_and_trajectory_in_global_atom_order(tmp_path):
    import ase.io

    path = tmp_path / "md.extxyz"
    results = run_ranks(_logged_run, 2, str(path), timeout=120)
    assert "pe[eV]" in results[0]["log"] and results[1]["log"] == ""
    # every rank has the same (globally reduced) numbers
    assert results[0]["records"] == results[1]["records"]
    # a GLOBAL hook sees the whole system, the same on every rank, matching the reduced sums
    assert results[0]["kinetic"] == results[1]["kinetic"]
    ekin = {r["step"]: r["ekin"] for r in results[0]["records"]}
    for step, n_atoms, by_hand, via_view in results[0]["kinetic"]:
        assert n_atoms == hot_liquid().num_atoms
        assert abs(by_hand - ekin[step]) < 1e-10 and abs(via_view - ekin[step]) < 1e-10
    frames = ase.io.read(str(path), index=":")
    assert [f.info["step"] for f in frames] == [0, 10, 20, 30]
    expected = single_process("nve", 30, every=10)
    for frame in frames:
        ref = expected[frame.info["step"]]
        cell = torch.as_tensor(frame.cell[:], dtype=torch.float64)
        # written positions are wrapped into the cell: compare modulo the cell
        frac = torch.as_tensor(frame.get_positions()) @ torch.linalg.inv(cell)
        ref_frac = ref["positions"] @ torch.linalg.inv(cell)
        delta = frac - ref_frac
        assert (delta - delta.round()).abs().max() < 1e-9


def _failing_run(rank, world_size, tmp, fail_rank, fail_step):
    class Boom:
        stage = DynamicsStage.AFTER_STEP
        frequency = 1
        scope = HookScope.LOCAL

        def __call__(self, ctx, stage):
            if rank == fail_rank and ctx.step == fail_step:
                raise ValueError(f"hook exploded on rank {rank} at step {ctx.step}")

    hooks = [
        TrajectoryWriter(f"{tmp}/md.extxyz", frequency=1),
        CheckpointWriter(f"{tmp}/state.pt", frequency=2),
        Boom(),
    ]
    start = time.perf_counter()
    try:
        with DomainParallel(integrator("nvt"), DomainConfig(cutoff=CUTOFF), 100, hooks=hooks) as dp:
            dp.partition(hot_liquid() if rank == 0 else None)
            dp.run()
    finally:
        elapsed = time.perf_counter() - start
        with open(f"{tmp}/elapsed_{rank}", "w") as f:
            f.write(str(elapsed))


def test_failing_rank_stops_every_rank_promptly(tmp_path):
    import ase.io
    from mlipdd.distributed import load_checkpoint

    with pytest.raises(RankFailure) as info:
        run_ranks(_failing_run, 3, str(tmp_path), 1, 5, timeout=60)
    failures = info.value.failures
    assert sorted(failures) == [0, 1, 2]
    assert all("hook exploded on rank 1 at step 5" in text for text in failures.values())
    assert "ValueError" in failures[1] and "RemoteRankError" in failures[0]
    # the others stopped within seconds of the failure, not at a timeout
    assert max(float((tmp_path / f"elapsed_{r}").read_text()) for r in range(3)) < 30
    frames = ase.io.read(str(tmp_path / "md.extxyz"), index=":")
    assert [f.info["step"] for f in frames][:5] == [0, 1, 2, 3, 4]
    assert len(frames[0]) == hot_liquid().num_atoms
    checkpoint = load_checkpoint(tmp_path / "state.pt")
    assert checkpoint.step == 4 and checkpoint.batch.num_atoms == hot_liquid().num_atoms


def _long_run(rank, world_size, n_steps):
    snaps = Snapshots(n_steps)
    with DomainParallel(integrator("nve"), DomainConfig(cutoff=CUTOFF), n_steps, hooks=[snaps]) as dp:
        dp.partition(hot_liquid() if rank == 0 else None)
        dp.run()
        return {"frames": snaps.frames, "ids": dp.batch.atom_ids.clone(), "rebuilds": dp.strategy.rebuilds}


@pytest.mark.slow  # about 3 minutes on 2 cores
def test_long_hot_liquid_conserves_atoms_ids_momentum():
    n_steps = 5000
    results = run_ranks(_long_run, 4, n_steps, timeout=600)
    ids = torch.sort(torch.cat([r["ids"] for r in results])).values
    assert torch.equal(ids, torch.arange(hot_liquid().num_atoms))
    frames = results[0]["frames"]
    assert torch.equal(frames[n_steps]["ids"], torch.arange(hot_liquid().num_atoms))
    assert (frames[n_steps]["momentum"] - frames[0]["momentum"]).abs().max() < 1e-9
    assert min(r["rebuilds"] for r in results) > 50


def _mlipdd(*args, timeout=180):
    import subprocess
    import sys

    command = [sys.executable, "-c", "import sys; from mlipdd.cli import main; sys.exit(main())"]
    return subprocess.run([*command, *args], check=False, capture_output=True, text=True, timeout=timeout)


def test_cli_nproc_starts_ranks_and_reports_the_check():
    import json

    done = _mlipdd("run", "--nproc", "2", "--steps", "10", "--size", "3", "--log-every", "0", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["ranks"] == 2 and summary["atoms_conserved"] is True
    assert summary["n_atoms"] == 108 and summary["max_force_diff_eV_per_A"] < 1e-10


def test_cli_bad_input_fails_once_with_the_fix(capfd):
    """In this process (`mlipdd.cli.main`): the launch above is the fresh-process one."""
    from mlipdd.cli import main

    start = time.perf_counter()
    assert main(["run", "--nproc", "2", "--steps", "5", "--system", "no_such_file.xyz"]) != 0
    err = capfd.readouterr().err  # the launcher's ranks write to the process's stderr
    assert "neither a built-in" in err and err.count("neither a built-in") == 1, err
    assert time.perf_counter() - start < 60
