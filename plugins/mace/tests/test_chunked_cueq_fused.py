"""Chunked evaluation of cuEq's FUSED convolution (mace's default on CUDA) equals the plain
fused model, in one process and under domain decomposition (halo and sharded).

On CPU the fused calling convention runs on cuequivariance's torch reference kernels through
`reference_fused_cueq_wrapper` (the same polynomial call as mace's fused block); the GPU
check with mace's own kernel is .old/gpu/cueq_chunk_fused.py. float64: measured ~1e-15.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mlipdd.testing.conformance import gather_by_id, relative_difference
from mlipdd.testing.spawn import run_ranks
from mlipdd_mace.chunked import unsupported_blocks
from mlipdd_mace.chunked_fused import _polynomial_call, _row_spans
from mlipdd_mace.cueq import FIRED
from mlipdd_mace.testing import (
    COMPARED_OUTPUTS,
    SMALL_CUEQ_ARCH,
    outputs_per_strategy,
    reference_fused_cueq_wrapper,
    small_cueq_systems,
)
from mlipdd_mace.wrapper import MACEWrapper


def chunked_fused_wrapper(chunk_atoms, **kwargs):
    """The fused reference model, chunked (module level: spawned ranks unpickle it)."""
    return MACEWrapper(reference_fused_cueq_wrapper(**kwargs).model, chunk_atoms=chunk_atoms)


@pytest.fixture(scope="module")
def fused_model():
    return reference_fused_cueq_wrapper(**SMALL_CUEQ_ARCH)


def test_row_spans_cover_each_chunk():
    index = torch.tensor([[5, 0, 9, 2, 3, 7, 1], [1, 1, 2, 2, 8, 8, 4]])  # senders, receivers
    assert _row_spans(index, 3, 12, separate=True) == [(0, 10, 1, 3), (2, 8, 2, 9), (1, 2, 4, 5)]
    assert _row_spans(index, 3, 12, separate=False) == [(0, 10, 0, 10), (2, 9, 2, 9), (1, 5, 1, 5)]
    assert _row_spans(index, 7, 12, separate=True) == [(0, 10, 1, 9)]
    assert _row_spans(index[:, :0], 3, 12, separate=True) == []


def test_chunked_fused_equals_plain_fused(fused_model):
    assert unsupported_blocks(fused_model.model) == [], "the fused blocks must be chunked, not skipped"
    for name in ("triclinic", "slab"):
        batch = small_cueq_systems()[name]
        ref = fused_model(batch.clone(), compute_stress=True)
        for chunk_atoms in (1, 7, 10_000):  # hundreds of chunks, uneven chunks, one chunk
            before = FIRED["mace_cueq:fused_conv_chunked"]
            out = MACEWrapper(fused_model.model, chunk_atoms=chunk_atoms)(batch.clone(), compute_stress=True)
            assert FIRED["mace_cueq:fused_conv_chunked"] - before == len(fused_model.model.interactions)
            for key in COMPARED_OUTPUTS:
                if key in ref:
                    assert relative_difference(out[key].detach(), ref[key].detach()) < 1e-12, (name, chunk_atoms, key)
    assert all(p.requires_grad for p in fused_model.model.parameters()), "parameters must be unfrozen afterwards"


def test_chunked_fused_without_host_reads(fused_model, monkeypatch):
    """Under a CUDA-graph capture or a compile trace the spans cannot be read on the host:
    every chunk then gets the whole table, still exact."""
    from mlipdd_mace import chunked_fused

    batch = small_cueq_systems()["slab"]
    ref = fused_model(batch.clone(), compute_stress=True)
    monkeypatch.setattr(chunked_fused, "capturing", lambda tensor: True)
    assert chunked_fused._row_spans(torch.tensor([[0, 3], [1, 2]]), 1, 9, separate=True) == [(0, 9, 0, 9)] * 2
    out = MACEWrapper(fused_model.model, chunk_atoms=5)(batch.clone(), compute_stress=True)
    for key in ("energy", "forces", "stress"):
        assert relative_difference(out[key].detach(), ref[key].detach()) < 1e-12, key


class _ForwardOnly(torch.nn.Module):
    """A fused convolution seen only through its public ``forward(node_feats, edge_attrs,
    tp_weights, edge_index)`` (any fused form other than cuEq's): chunked on one joint span."""

    def __init__(self, fused):
        super().__init__()
        self.inner = fused

    def forward(self, node_feats, edge_attrs, tp_weights, edge_index):
        return self.inner(node_feats, edge_attrs, tp_weights, edge_index)


def test_chunked_fused_through_its_public_call(fused_model):
    batch = small_cueq_systems()["triclinic"]
    ref = fused_model(batch.clone(), compute_stress=True)
    model = reference_fused_cueq_wrapper(**SMALL_CUEQ_ARCH).model
    for block in model.interactions:
        block.conv_tp = _ForwardOnly(block.conv_tp)
    assert _polynomial_call(model.interactions[0].conv_tp) is None
    assert _polynomial_call(fused_model.model.interactions[0].conv_tp) is not None
    out = MACEWrapper(model, chunk_atoms=5)(batch.clone(), compute_stress=True)
    for key in ("energy", "forces", "stress"):
        assert relative_difference(out[key].detach(), ref[key].detach()) < 1e-12, key


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_chunked_fused_distributed_equals_plain_fused(fused_model, world_size):
    """gloo ranks, chunked fused convolution (3 atoms' worth of edges per kernel call) vs one
    plain fused process: triclinic, own images, vacuum (a rank may own no atom), halo and sharded."""
    systems = small_cueq_systems()
    refs = {name: fused_model(b.clone(), compute_stress=True) for name, b in systems.items()}
    factory = functools.partial(chunked_fused_wrapper, 3, **SMALL_CUEQ_ARCH)
    strategies = ("halo", "sharded")
    parts = run_ranks(outputs_per_strategy, world_size, factory, list(systems.values()), strategies, timeout=600)
    for strategy in strategies:
        assert sum(p[strategy, i]["n_ghost"] for p in parts for i in range(len(systems))) > 0, "no remote row read"
        for i, (name, batch) in enumerate(systems.items()):
            per_rank = [p[strategy, i] for p in parts]
            # the chunks call the kernel on plain rows: the unchunked fused rule must not fire
            assert all(o["cueq_fused_calls"] == 0 for o in per_rank), "a fused block ran unchunked"
            assert all(o["cueq_rule_calls"] > 0 for o in per_rank)
            forces = gather_by_id(per_rank, "forces", batch.num_atoms)
            ref, where = refs[name], f"{strategy} {name}"
            assert relative_difference(per_rank[0]["energy"], ref["energy"].detach()) < 1e-12, where
            assert relative_difference(forces, ref["forces"].detach()) < 1e-10, where
            assert relative_difference(per_rank[0]["stress"], ref["stress"].detach()) < 1e-10, where


def test_memory_estimate_of_the_fused_path(fused_model):
    """The fused blocks answer the estimate (their convolution has no irreps of its own), keep
    no message per edge (less than the unfused form of the same model), and chunking shrinks it."""
    unfused = MACEWrapper(reference_fused_cueq_wrapper(**SMALL_CUEQ_ARCH).model)
    for block in unfused.model.interactions:
        del block.conv_fusion
    atoms, edges = 100_000, 4_500_000
    fused = MACEWrapper(fused_model.model, chunk_atoms=1000).memory_estimate(atoms, edges)
    assert fused["bytes"] < fused["plain_bytes"] / 2
    assert fused["plain_bytes"] < unfused.memory_estimate(atoms, edges)["bytes"]


def test_vjp_backward_equals_the_recomputing_one(fused_model, monkeypatch):
    """The backward applies cuEq's VJP polynomial to the recomputed radial weights; the first
    version ran the chunk's kernel forward again and differentiated it. Same gradients."""
    from mlipdd_mace import chunked_fused

    batch = small_cueq_systems()["small_cell"]
    before = FIRED["mace_cueq:fused_conv_chunked_vjp"]
    vjp = MACEWrapper(fused_model.model, chunk_atoms=4)(batch.clone(), compute_stress=True)
    assert FIRED["mace_cueq:fused_conv_chunked_vjp"] - before == len(fused_model.model.interactions)
    monkeypatch.setattr(chunked_fused, "RECOMPUTE_CONVOLUTION", True)
    before = FIRED["mace_cueq:fused_conv_chunked_vjp"]
    recomputed = MACEWrapper(fused_model.model, chunk_atoms=4)(batch.clone(), compute_stress=True)
    assert FIRED["mace_cueq:fused_conv_chunked_vjp"] == before, "RECOMPUTE_CONVOLUTION must bypass the VJP"
    ref = fused_model(batch.clone(), compute_stress=True)
    for key in ("energy", "forces", "stress"):
        assert relative_difference(vjp[key].detach(), recomputed[key].detach()) < 1e-13, key
        assert relative_difference(vjp[key].detach(), ref[key].detach()) < 1e-12, key


def test_cutoff_folded_into_the_radial_mlp(fused_model):
    """mace's weights are ``R(f) * c``; the chunks compute ``last(hidden(f) * c)``, the same
    up to rounding, only for a radial MLP whose last layer is linear without bias."""
    from mace.modules.radial import RadialMLP

    from mlipdd_mace.chunked import _bias_free_last_layer, radial_weights

    block = fused_model.model.interactions[1]
    assert _bias_free_last_layer(block.conv_tp_weights) is not None, "the fold must apply to mace's MLP"
    torch.manual_seed(0)
    feats = torch.rand(50, block.conv_tp_weights.hs[0], dtype=torch.float64)
    cutoff = torch.rand(50, 1, dtype=torch.float64)
    mace_order = block.conv_tp_weights(feats) * cutoff
    assert relative_difference(radial_weights(block, feats, cutoff), mace_order) < 1e-14
    assert torch.equal(radial_weights(block, feats, None), block.conv_tp_weights(feats))
    assert _bias_free_last_layer(RadialMLP([8, 16, 32])) is None, "a last layer with a bias is not linear"


def test_row_spans_read_once_per_forward(fused_model, monkeypatch):
    """Both layers chunk the same edge list over the same table: one host read per forward."""
    from mlipdd_mace import chunked_fused

    reads = []
    original = chunked_fused._row_spans
    monkeypatch.setattr(chunked_fused, "_row_spans", lambda *a: reads.append(a) or original(*a))
    MACEWrapper(fused_model.model, chunk_atoms=5)(small_cueq_systems()["slab"].clone())
    assert len(reads) == 1 and len(fused_model.model.interactions) == 2
    MACEWrapper(fused_model.model, chunk_atoms=5)(small_cueq_systems()["slab"].clone())
    assert len(reads) == 2, "the cache must not outlive its forward"
