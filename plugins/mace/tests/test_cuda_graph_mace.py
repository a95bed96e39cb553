"""MACE under DomainConfig(cuda_graph=True): null edges weigh nothing (CPU, float64), and
the graphed one-rank MD force calls equal the eager ones on a GPU (the `cuda` tests)."""

from __future__ import annotations

import pytest
import torch
from mace_structures import ELEMENTS, R_MAX, STRUCTURES

from mlipdd.data import Batch
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.distributed.cuda_graph import pad_with_null_edges
from mlipdd.neighbors import attach_neighbors
from mlipdd.testing.graph_replay import graphed_vs_eager_md, with_eager_replay
from mlipdd_mace.testing import random_mace
from mlipdd_mace.wrapper import MACEWrapper

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SKIN = 0.5


@pytest.mark.parametrize("name", ["triclinic", "tiny_cell", "slab"])  # a graph needs a cell
def test_null_edges_weigh_nothing_in_mace(mace_model, name):
    """What mace sees under a capture: the whole skin list (nothing filtered on the host)
    plus null edges (an atom and its own image past the list's reach). Energy, per-atom
    energies, forces and stress equal those of the list mace's own filter keeps."""
    wrapper = MACEWrapper(mace_model)
    batch = Batch.from_ase(STRUCTURES[name]())
    attach_neighbors(batch, R_MAX + SKIN)
    plain = wrapper(batch, compute_stress=True)  # filtered to r_max on the host
    edges = batch.neighbors.num_edges
    padded = pad_with_null_edges(batch.neighbors, batch, capacity=2 * edges + 5)
    # a padded list (a graph's): no host-side filter, every edge (skin and null) reaches mace
    view = Batch._from_dicts(dict(batch.node), dict(batch.system))
    view.neighbors = padded
    assert wrapper.adapt_input(view)["edge_index"].shape[1] == 2 * edges + 5
    got = wrapper(view, compute_stress=True)
    for key in ("energy", "energies", "forces", "stress"):
        torch.testing.assert_close(got[key], plain[key], rtol=0, atol=1e-12, msg=key)


def _diamond(reps=(2, 2, 2)):
    import numpy as np
    from ase.build import bulk

    atoms = bulk("C", "diamond", a=3.7, cubic=True).repeat(reps)
    rng = np.random.default_rng(5)
    atoms.numbers[rng.choice(len(atoms), len(atoms) // 4, replace=False)] = 1
    atoms.numbers[rng.choice(len(atoms), len(atoms) // 8, replace=False)] = 8
    atoms.set_cell(atoms.cell + np.array([[0.0, 0.3, 0.2], [0.4, 0.0, 0.1], [0.2, 0.5, 0.0]]), scale_atoms=True)
    atoms.rattle(0.05, seed=6)
    return atoms


def md_graphed_vs_eager(dtype, steps, dt, stress_every=0, device="cuda"):
    """Velocity Verlet on the eager forces of a 1-rank DistributedModel; at every step a
    second one, replayed from a CUDA graph (on CPU: `EagerReplay`), gets the same positions. Returns
    (rebuilds, captures, worst relative force difference, worst energy difference / atom)."""
    model = MACEWrapper(random_mace(elements=ELEMENTS, r_max=R_MAX, dtype=dtype, seed=1)).to(device)
    batch = Batch.from_ase(_diamond(), dtype=dtype)
    eager = DistributedModel(model, DomainConfig(cutoff=R_MAX, skin=SKIN))
    graphed = DistributedModel(model, DomainConfig(cutoff=R_MAX, skin=SKIN, cuda_graph=True))
    if device == "cpu":
        with_eager_replay(graphed)  # everything but the capture: padded lists, null edges, trimming
    owned, mirror = eager.partition(batch, device=device), graphed.partition(batch, device=device)
    generator = torch.Generator().manual_seed(2)
    velocities = (0.03 * torch.randn(owned.positions.shape, generator=generator)).to(device, dtype)
    worst_force = worst_energy = 0.0
    for _, stress, a, b in graphed_vs_eager_md(eager, graphed, owned, mirror, velocities, steps, dt, stress_every):
        worst_force = max(worst_force, float((a["forces"] - b["forces"]).abs().max() / a["forces"].abs().max()))
        worst_energy = max(worst_energy, float((a["energy"] - b["energy"]).abs().max()) / batch.num_atoms)
        if stress:
            scale = float(a["stress"].abs().max())
            worst_force = max(worst_force, float((a["stress"] - b["stress"]).abs().max()) / scale)
    return eager.strategy.rebuilds, graphed.cuda_graph_captures, worst_force, worst_energy


def test_graph_bookkeeping_mace_md_on_cpu():
    """The graphed path minus the capture, on CPU: mace keeps every edge of the padded list
    (null edges included) and still equals eager, with and without stress."""
    rebuilds, captures, force, energy = md_graphed_vs_eager(torch.float64, steps=12, dt=0.3, stress_every=4,
                                                            device="cpu")
    assert rebuilds >= 2 and captures == 2, (rebuilds, captures)
    assert force <= 1e-12 and energy <= 1e-12, (force, energy)


@needs_cuda
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-4)], ids=["f64", "f32"])
def test_cuda_graph_mace_md_matches_eager(dtype, tol):
    """64 atoms, H/C/O, triclinic: list rebuilds every few steps, one capture."""
    rebuilds, captures, force, energy = md_graphed_vs_eager(dtype, steps=30, dt=0.3)
    assert rebuilds >= 4, rebuilds
    assert captures == 1, captures
    assert force <= tol and energy <= tol, (force, energy)


@needs_cuda
def test_cuda_graph_mace_stress_matches_eager():
    """A stress every third step: two graphs (with and without stress), both kept."""
    _, captures, force, energy = md_graphed_vs_eager(torch.float64, steps=9, dt=0.3, stress_every=3)
    assert captures == 2, captures
    assert force <= 1e-10 and energy <= 1e-10, (force, energy)
