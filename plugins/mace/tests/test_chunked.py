"""Chunked MACE (`MACEWrapper(chunk_atoms=...)`) equals the plain model, alone and distributed."""

from __future__ import annotations

import functools

import pytest
import torch

from mlipdd.testing.conformance import gather_by_id, relative_difference
from mlipdd.testing.spawn import run_ranks
from mlipdd.testing.systems import slab, small_cell, triclinic
from mlipdd_mace.chunked import unsupported_blocks
from mlipdd_mace.testing import distributed_outputs_of_each, random_mace, random_mace_wrapper
from mlipdd_mace.wrapper import MACEWrapper

SPECIES = (1, 6, 8)
# max_ell 3 / correlation 3 like the medium model, few channels to stay quick on a CPU
ARCH = {"elements": SPECIES, "r_max": 4.0, "channels": 8, "max_ell": 3, "correlation": 3, "dtype": torch.float64,
        "seed": 0}


def _systems():
    return {
        "triclinic": triclinic(species=SPECIES, spacing=2.5, reps=4),
        "small_cell": small_cell(species=SPECIES, spacing=2.5, reps=2),
        "slab": slab(species=SPECIES, spacing=2.5, reps=(4, 4, 2), vacuum=6.0),
    }


def _assert_same(out, ref, tol=1e-10):
    for key in ("energy", "forces", "stress", "energies"):
        if key in ref:
            assert relative_difference(out[key].detach(), ref[key].detach()) < tol, key


@pytest.mark.parametrize("scale_shift", [True, False])
def test_chunked_equals_plain_for_every_chunk_size(scale_shift):
    model = random_mace(**ARCH, scale_shift=scale_shift)
    assert unsupported_blocks(model) == []
    batch = _systems()["triclinic"]
    ref = MACEWrapper(model)(batch, compute_stress=True)
    # 1 atom per chunk (hundreds of chunks), uneven chunks, one chunk
    for chunk_atoms in (1, 7, 10_000):
        out = MACEWrapper(model, chunk_atoms=chunk_atoms)(batch.clone(), compute_stress=True)
        _assert_same(out, ref)
    assert all(p.requires_grad for p in model.parameters()), "parameters must be unfrozen afterwards"


def test_chunked_batch_of_systems_and_training_fallback():
    model = random_mace(**ARCH)
    systems = _systems()
    from mlipdd.data import Batch

    batch = Batch.from_data_list([systems["small_cell"], systems["slab"]])
    ref = MACEWrapper(model)(batch, compute_stress=True)
    chunked = MACEWrapper(model, chunk_atoms=5)
    _assert_same(chunked(batch.clone(), compute_stress=True), ref)
    # training needs the forces' graph (create_graph): the plain model runs, weights get gradients
    chunked.train()
    out = chunked(batch.clone())
    out["forces"].square().sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_chunk_atoms_must_be_positive_and_estimate_shrinks():
    model = random_mace(**ARCH)
    with pytest.raises(ValueError, match="chunk_atoms must be a positive"):
        MACEWrapper(model, chunk_atoms=0)
    estimate = MACEWrapper(model, chunk_atoms=1000).memory_estimate(100_000, 4_500_000)
    assert estimate["bytes"] < estimate["plain_bytes"] / 4
    assert "GiB" in estimate["summary"]


@pytest.mark.parametrize(("strategy", "world_size"), [("halo", 2), ("sharded", 2), ("sharded", 3), ("sharded", 4)])
def test_chunked_distributed_equals_plain_single_process(strategy, world_size):
    """gloo ranks, chunked, vs one plain process: triclinic, own images, vacuum (1e-10);
    under halo storage and under sharded storage (remote senders fetched per layer)."""
    systems = _systems()
    plain = random_mace_wrapper(**ARCH)
    refs = {name: plain(b.clone(), compute_stress=True) for name, b in systems.items()}
    factory = functools.partial(random_mace_wrapper, chunk_atoms=3, **ARCH)
    parts = run_ranks(distributed_outputs_of_each, world_size, factory, list(systems.values()), True,
                      {"strategy": strategy}, timeout=600)
    assert sum(out["n_ghost"] for p in parts for out in p) > 0, "no remote row was read: nothing tested"
    for i, (name, batch) in enumerate(systems.items()):
        per_rank = [p[i] for p in parts]
        forces = gather_by_id(per_rank, "forces", batch.num_atoms)
        ref = refs[name]
        assert relative_difference(per_rank[0]["energy"], ref["energy"].detach()) < 1e-12, name
        assert relative_difference(forces, ref["forces"].detach()) < 1e-10, name
        assert relative_difference(per_rank[0]["stress"], ref["stress"].detach()) < 1e-10, name
