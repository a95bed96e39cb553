"""Checkpoint / restart: a run on W ranks continues on any number of ranks, one included."""

import os

import pytest
import torch
from mlipdd.data import InputError
from mlipdd.distributed import (
    CheckpointWriter,
    DomainConfig,
    DomainParallel,
    load_checkpoint,
    restore_dynamics,
    save_checkpoint,
)
from mlipdd.distributed.checkpoint import checkpoint_payload, write_atomically
from mlipdd.testing import run_ranks
from test_domain_parallel import CUTOFF, Snapshots, hot_liquid, integrator

FIRST, MORE, EVERY = 60, 60, 20


def _config():
    return DomainConfig(cutoff=CUTOFF, skin=0.5)


def _source_run(rank, world_size, kind, path):
    """FIRST steps, checkpoint, MORE steps: the uninterrupted trajectory."""
    snaps = Snapshots(EVERY)
    with DomainParallel(integrator(kind), _config(), FIRST, hooks=[snaps]) as dp:
        dp.partition(hot_liquid() if rank == 0 else None)
        dp.run()
        dp.save_checkpoint(path)
        dp.run(MORE)
        return {"frames": snaps.frames, "rebuilds": dp.strategy.rebuilds}


def _restarted_run(rank, world_size, kind, path):
    snaps = Snapshots(EVERY)
    with DomainParallel(integrator(kind), _config(), MORE, hooks=[snaps]) as dp:
        dp.restore(path)
        dp.run()
        bath = getattr(dp.dynamics, "bath_energy", None)
        return {"frames": snaps.frames, "bath": bath}


def _restart_single_process(kind, path):
    checkpoint = load_checkpoint(path)
    snaps = Snapshots(EVERY)
    dyn = integrator(kind, [snaps])
    restore_dynamics(dyn, checkpoint)
    dyn.run(checkpoint.batch, MORE)
    return {"frames": snaps.frames, "bath": getattr(dyn, "bath_energy", None)}


def _assert_continues(restarted, source, tol=1e-10):
    steps = [s for s in source if s >= FIRST]
    assert sorted(restarted) == steps
    for step in steps:
        a, b = restarted[step], source[step]
        assert torch.equal(a["ids"], b["ids"])
        dx = (a["positions"] - b["positions"]).abs().max().item()
        dv = (a["velocities"] - b["velocities"]).abs().max().item()
        assert dx < tol and dv < tol, f"step {step}: positions off by {dx:.3g}, velocities {dv:.3g}"


@pytest.fixture(scope="module")
def nve_source(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "nve.pt"
    results = run_ranks(_source_run, 2, "nve", str(path), timeout=180)
    assert min(r["rebuilds"] for r in results) > 1  # atoms migrated before the checkpoint
    return path, results[0]["frames"]


def test_checkpoint_holds_the_full_state(nve_source):
    path, _ = nve_source
    checkpoint = load_checkpoint(path)
    batch = checkpoint.batch
    assert checkpoint.world_size == 2 and checkpoint.step == FIRST
    assert checkpoint.dynamics_class == "NVE"
    assert torch.equal(batch.atom_ids, torch.arange(hot_liquid().num_atoms))
    for field in ("positions", "velocities", "atomic_masses", "atomic_numbers", "image"):
        assert field in batch.node
    assert "forces" not in batch.node  # recomputed on restart
    assert int(batch.image.abs().sum()) > 0  # atoms crossed the periodic boundary
    assert not list(path.parent.glob(".*.tmp"))


def test_restart_on_three_ranks_continues_the_trajectory(nve_source):
    path, source = nve_source
    results = run_ranks(_restarted_run, 3, "nve", str(path), timeout=180)
    _assert_continues(results[0]["frames"], source)


def test_restart_on_one_process_without_dd_continues_the_trajectory(nve_source):
    path, source = nve_source
    _assert_continues(_restart_single_process("nve", path)["frames"], source)


def test_langevin_restart_keeps_noise_and_bath_ledger(tmp_path):
    path = tmp_path / "nvt.pt"
    source = run_ranks(_source_run, 2, "nvt", str(path), timeout=180)[0]["frames"]
    restarted = run_ranks(_restarted_run, 3, "nvt", str(path), timeout=180)
    _assert_continues(restarted[0]["frames"], source)
    single = _restart_single_process("nvt", path)
    _assert_continues(single["frames"], source)
    assert torch.allclose(single["bath"], restarted[0]["bath"], rtol=0, atol=1e-9)


def test_checkpoint_writer_on_a_plain_integrator(tmp_path):
    path = tmp_path / "plain.pt"
    writer = CheckpointWriter(path, frequency=5)
    dyn = integrator("nve", [writer])
    dyn.run(hot_liquid(), 12)
    assert writer.saved_steps == [5, 10, 12]  # and once more at the end of the run
    checkpoint = load_checkpoint(path)
    assert checkpoint.step == 12 and checkpoint.world_size == 1
    assert torch.equal(checkpoint.batch.image, torch.zeros_like(checkpoint.batch.image))


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "state.pt"
    dyn = integrator("nve")
    batch = hot_liquid()
    dyn.run(batch, 2)
    save_checkpoint(path, batch, dyn)
    payload = checkpoint_payload(batch, dyn)

    def broken_save(obj, handle):
        handle.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(payload, path)
    monkeypatch.undo()
    assert load_checkpoint(path).step == 2
    assert sorted(os.listdir(tmp_path)) == ["state.pt"]


def test_clear_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(InputError, match="cannot be read"):
        load_checkpoint(junk)
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(InputError, match="not an mlipdd checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    path = tmp_path / "nve.pt"
    dyn = integrator("nve")
    batch = hot_liquid()
    dyn.run(batch, 1)
    save_checkpoint(path, batch, dyn)
    with pytest.raises(InputError, match="written by NVE"):
        restore_dynamics(integrator("nvt"), load_checkpoint(path))
