"""DomainConfig(cuda_graph=True): null-edge padding, the graph's input buffers, refusals
(CPU), and graphed == eager on a GPU (the `cuda` tests, skipped without CUDA)."""

import math

import pytest
import torch
from mlipdd.data import Batch, InputError
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.distributed.cuda_graph import GraphedForceCall, StaticInputs, pad_with_null_edges
from mlipdd.lattices import silicon_diamond
from mlipdd.models.lj import LennardJones
from mlipdd.neighbors import attach_neighbors
from mlipdd.testing import run_ranks
from mlipdd.testing.graph_replay import graphed_vs_eager_md, with_eager_replay
from mlipdd.testing.systems import slab, small_cell, triclinic, two_systems

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SYSTEMS = {"triclinic": triclinic, "small_cell": small_cell, "slab": slab, "two_systems": two_systems}


def lj(cutoff=7.0):
    # two species with different parameters: the per-edge lookups are exercised too
    return LennardJones(epsilon={18: 0.0104, 36: 0.014}, sigma={18: 3.4, 36: 3.6}, cutoff=cutoff)


def _with_list(batch: Batch, reach: float) -> Batch:
    attach_neighbors(batch, reach)
    return batch


def _view(batch: Batch, neighbors) -> Batch:
    view = Batch._from_dicts(dict(batch.node), dict(batch.system))
    view.neighbors = neighbors
    return view


# ---- null edges (CPU, float64) ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_null_edges_change_nothing_lj(name):
    """A list padded with null edges (an atom and its own image beyond the list's reach)
    gives the same energy, per-atom energies, forces and stress as the list itself."""
    model = lj()
    batch = _with_list(SYSTEMS[name](species=(18, 36)), model.cutoff + 0.5)  # a skin, as under DD
    plain = model(batch, compute_stress=True)
    edges = batch.neighbors.num_edges
    padded_list = pad_with_null_edges(batch.neighbors, batch, capacity=math.ceil(1.3 * edges) + 7)
    null = padded_list.edge_index[:, edges:]
    assert null.shape[1] > edges // 4 and bool((null[0] == null[1]).all())
    lengths = padded_list.edge_vectors(batch.positions, batch.cell, batch.batch)[edges:].norm(dim=1)
    assert float(lengths.min()) >= model.cutoff + 0.5 + 1.0 - 1e-9
    padded = model(_view(batch, padded_list), compute_stress=True)
    for key in ("energy", "energies", "forces", "stress"):
        torch.testing.assert_close(padded[key], plain[key], rtol=0, atol=1e-12, msg=key)


# ---- the graph's input buffers (CPU: the bookkeeping, no graph) ----------------------------


def test_static_inputs_refill_and_decide_when_to_capture():
    """Between captures a new list is copied into the same buffers (null-padded), floats
    are refreshed in place; a list past the capacity, new atomic numbers or the stress
    flag call for a new capture. The model run on the buffers equals the model run on
    the batch at every step."""
    model = lj()
    batch = _with_list(triclinic(species=(18, 36)), model.cutoff + 0.5)
    static = StaticInputs(batch, compute_stress=True, capacity=batch.neighbors.num_edges + 40)
    buffers = (static.batch.positions, static.batch.neighbors.edge_index)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        moved = Batch._from_dicts(dict(batch.node), dict(batch.system))
        moved.node["positions"] = batch.positions + 0.05 * torch.randn(batch.positions.shape, generator=generator)
        if step > 0:
            attach_neighbors(moved, model.cutoff + 0.5)  # a "rebuild": a new list object
        else:
            moved.neighbors = batch.neighbors
        assert static.holds(moved, compute_stress=True)
        static.load(moved)
        assert (static.batch.positions, static.batch.neighbors.edge_index) == buffers  # same tensors
        assert static.batch.positions.requires_grad and static.batch.positions.is_leaf
        expected = model(moved, compute_stress=True)
        got = model(static.batch, compute_stress=True)
        for key in ("energy", "forces", "stress"):
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-12, msg=key)
    assert not static.holds(moved, compute_stress=False)  # stress flag
    swapped = Batch._from_dicts(dict(moved.node), dict(moved.system))
    swapped.neighbors = moved.neighbors
    swapped.node["atomic_numbers"] = torch.where(moved.atomic_numbers == 18, 36, 18)
    assert not static.holds(swapped, compute_stress=True)  # new elements: a new capture
    same = Batch._from_dicts(dict(moved.node), dict(moved.system))
    same.neighbors = moved.neighbors
    same.node["atomic_numbers"] = moved.atomic_numbers.clone()  # new tensor, same values
    assert static.holds(same, compute_stress=True)
    denser = _with_list(Batch._from_dicts(dict(moved.node), dict(moved.system)), model.cutoff + 2.0)
    assert denser.neighbors.num_edges > static.capacity
    assert not static.holds(denser, compute_stress=True)  # outgrew the buffers


# ---- refusals -------------------------------------------------------------------------------


def test_cuda_graph_refusals_on_one_process():
    model = LennardJones(epsilon=0.0104, sigma=3.4, cutoff=7.0)
    with pytest.raises(InputError, match="strategy='halo'"):
        DomainConfig(cutoff=7.0, cuda_graph=True, strategy="sharded")
    dm = DistributedModel(model, DomainConfig(cutoff=7.0, cuda_graph=True))
    owned = dm.partition(silicon_diamond(2).to(dtype=torch.float64), device="cpu")
    with pytest.raises(InputError, match="CUDA device .* or leave cuda_graph=False"):
        dm(owned)
    with pytest.raises(InputError, match="headroom"):
        GraphedForceCall(model, headroom=0.5)


def _refused_on_rank(rank, world_size):
    model = LennardJones(epsilon=0.0104, sigma=3.4, cutoff=7.0)
    try:
        DistributedModel(model, DomainConfig(cutoff=7.0, cuda_graph=True))
    except InputError as error:
        return str(error)
    return None


def test_cuda_graph_refused_on_every_rank_of_two():
    for message in run_ranks(_refused_on_rank, 2):
        assert message is not None and "ONE rank" in message and "cuda_graph=False" in message


# ---- graphed == eager: on CUDA, and the same bookkeeping on CPU (EagerReplay) -------------


def _graphed_pair(model, skin, device):
    """An eager and a graphed 1-rank DistributedModel (on CPU: graphed by `EagerReplay`)."""
    config = {"cutoff": model.cutoff, "skin": skin}
    eager = DistributedModel(model, DomainConfig(**config))
    graphed = DistributedModel(model, DomainConfig(**config, cuda_graph=True))
    if device == "cpu":
        with_eager_replay(graphed)  # everything but the capture itself
    return eager, graphed


def _nve_graphed_vs_eager(model, batch, steps, dt, skin, stress_every=0, tol=1e-4, device="cuda"):
    """Velocity Verlet on the eager forces; at every step the graphed DistributedModel
    gets the same positions and must agree. Returns (rebuilds, captures, max force diff)."""
    eager, graphed = _graphed_pair(model, skin, device)
    owned = eager.partition(batch, device=device)
    mirror = graphed.partition(batch, device=device)
    generator = torch.Generator().manual_seed(1)
    velocities = (0.02 * torch.randn(owned.positions.shape, generator=generator, dtype=torch.float64)).to(
        device=owned.positions.device, dtype=owned.positions.dtype)
    worst = 0.0
    for step, stress, a, b in graphed_vs_eager_md(eager, graphed, owned, mirror, velocities, steps, dt, stress_every):
        scale = float(a["forces"].abs().max())
        diff = float((a["forces"] - b["forces"]).abs().max())
        worst = max(worst, diff / scale)
        torch.testing.assert_close(b["energy"], a["energy"], rtol=tol, atol=tol * abs(float(a["energy"][0])))
        torch.testing.assert_close(b["energies"], a["energies"], rtol=tol, atol=tol * abs(float(a["energy"][0])))
        if stress:
            torch.testing.assert_close(b["stress"], a["stress"], rtol=tol, atol=tol * float(a["stress"].abs().max()))
        assert diff <= tol * scale, (step, diff, scale)
    return eager.strategy.rebuilds, graphed.cuda_graph_captures, worst


def _lj_md(device):
    """Float64 LJ on a hot triclinic box: many list rebuilds, one capture (each call's
    edges are copied into the graph's buffers)."""
    model = lj().to(device)
    rebuilds, captures, _ = _nve_graphed_vs_eager(model, triclinic(species=(18, 36)), steps=40, dt=0.2, skin=0.3,
                                                  tol=1e-10, device=device)
    assert rebuilds >= 4 and captures == 1, (rebuilds, captures)


def _lj_md_stress(device):
    """A stress every third call: two graphs (with and without), each kept."""
    model = lj().to(device)
    _, captures, _ = _nve_graphed_vs_eager(model, two_systems(species=(18, 36)), steps=8, dt=0.2, skin=0.3,
                                           stress_every=3, tol=1e-10, device=device)
    assert captures == 2, captures


def _recapture(device):
    """Squeezing the box 1.5% keeps the graph (10% headroom); 20% doubles the edges: one
    new capture, still equal to eager."""
    model = lj().to(device)
    batch = small_cell(species=(18, 36), reps=3)
    eager, graphed = _graphed_pair(model, 0.5, device)
    owned, mirror = eager.partition(batch, device=device), graphed.partition(batch, device=device)
    for squeeze in (1.0, 0.985, 0.8):
        for b in (owned, mirror):
            b.system["cell"] = batch.cell.to(device) * squeeze
            b.node["positions"] = (batch.positions.to(device) * squeeze)[b.atom_ids]
        a, g = eager(owned, compute_stress=True), graphed(mirror, compute_stress=True)
        for key in ("energy", "forces", "stress"):
            torch.testing.assert_close(g[key], a[key], rtol=1e-10, atol=1e-12, msg=key)
        assert graphed.cuda_graph_captures == (1 if squeeze > 0.9 else 2), squeeze
    # the 1.5% squeeze keeps the list (the skin bound under strain, NOTE [skin under strain]);
    # the first call and the 20% squeeze build it
    assert eager.strategy.rebuilds == 2


def test_graph_bookkeeping_lj_md_matches_eager_on_cpu():
    _lj_md("cpu")


def test_graph_bookkeeping_recaptures_on_cpu():
    _recapture("cpu")


def test_graph_bookkeeping_stress_two_systems_on_cpu():
    _lj_md_stress("cpu")


@needs_cuda
def test_cuda_graph_lj_md_matches_eager_across_rebuilds():
    _lj_md("cuda")


@needs_cuda
def test_cuda_graph_lj_stress_two_systems():
    _lj_md_stress("cuda")


@needs_cuda
def test_cuda_graph_recaptures_when_edges_outgrow_the_buffers():
    _recapture("cuda")


# ---- MD under DomainParallel (one rank): graphed == eager, rebuilds and recaptures included ----


def _domain_parallel_md(rank, world_size, device, graphed, steps=60):
    from mlipdd.distributed import DomainParallel
    from mlipdd.dynamics import NVE
    from mlipdd.lattices import lj_liquid

    torch.set_default_dtype(torch.float64)
    model = LennardJones(epsilon=0.0104, sigma=3.4, cutoff=5.5).to(device)
    dm = DistributedModel(model, DomainConfig(cutoff=5.5, skin=0.5, cuda_graph=graphed))
    if graphed and device == "cpu":
        with_eager_replay(dm)
    with DomainParallel(NVE(dm, 2.0), n_steps=steps) as dp:
        dp.partition(lj_liquid(4, temperature=1500.0, seed=3) if rank == 0 else None)
        dp.run()
        order = torch.argsort(dp.batch.atom_ids)
        return dp.batch.positions[order].cpu(), dm.cuda_graph_captures, dp.strategy.rebuilds


def _graphed_run_equals_eager(device, backend):
    eager, _, rebuilds = run_ranks(_domain_parallel_md, 1, device, False, backend=backend)[0]
    graphed, captures, graphed_rebuilds = run_ranks(_domain_parallel_md, 1, device, True, backend=backend)[0]
    assert rebuilds >= 2 and graphed_rebuilds == rebuilds  # the hot liquid rebuilds its list
    assert 1 <= captures <= 4, captures  # edges outgrow the buffers at most a few times
    torch.testing.assert_close(graphed, eager, rtol=0, atol=1e-10)


def test_graph_bookkeeping_under_domain_parallel_on_cpu():
    """DomainParallel drives a graphed DistributedModel (capture replaced by eager calls)."""
    _graphed_run_equals_eager("cpu", "gloo")


@needs_cuda
def test_cuda_graph_under_domain_parallel_nccl():
    """The real capture under DomainParallel on one NCCL rank (refused until 2026-12-01: a
    one-rank `mlipdd run` with it was seen not to finish; on torch 2.11 / an H200 it runs
    60 steps with 3 captures, equal to eager to 4e-15)."""
    _graphed_run_equals_eager("cuda", "nccl")
