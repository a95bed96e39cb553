"""PME keeps its Green function between calls while the cell and mesh stay (NOTE [Green
function cache] in pme.py), and the cached calls equal the uncached ones to the last bit.

One process, float64 and float32: the replicated mesh with the Warp and the torch splines and
the distributed mesh; a batch of two cells (an entry each); atoms moved between calls (the cell
is what the key holds, not the positions); a changed cell (a new entry, equal to a fresh
evaluation); stress (a strained cell carries a gradient: never cached, equal as well). Under DD
(halo storage, replicated and distributed meshes, 2/3/4 gloo ranks): on every rank the cached
calls equal the uncached ones bit for bit, and the cache is hit.
"""

from __future__ import annotations

import functools

import pytest
import torch
from mlipdd.neighbors import attach_neighbors
from mlipdd.testing.pytest_plugin import parse_world_sizes
from mlipdd.testing.spawn import run_ranks
from mlipdd.testing.systems import two_systems
from mlipdd_ewald_pme import pme
from mlipdd_ewald_pme.testing import random_charges, rock_salt
from mlipdd_ewald_pme.wrappers import PMEWrapper

LAYOUTS = {"warp": {"spline": "warp"}, "torch": {"spline": "torch"}, "distributed": {"mesh": "distributed"}}


def pytest_generate_tests(metafunc):
    if "world_size" in metafunc.fixturenames:
        given = metafunc.config.getoption("mlipdd_world_sizes", None)
        metafunc.parametrize("world_size", parse_world_sizes(given) if given else (2, 3, 4))


def _outputs(model, batch, compute_stress=False):
    out = model(batch.clone(), compute_stress=compute_stress)
    return {k: v.detach() for k, v in out.items() if k in ("energy", "forces", "stress")}


def _uncached(model, batch, compute_stress=False):
    pme.GREEN_CACHE.enabled = False
    try:
        return _outputs(model, batch, compute_stress)
    finally:
        pme.GREEN_CACHE.enabled = True


def _assert_bit_equal(a, b, what):
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs by {float((a[key] - b[key]).abs().max()):.3g}"


def _moved(batch, seed):
    out = batch.clone()
    g = torch.Generator().manual_seed(seed)
    out.node["positions"] = out.positions + 0.05 * torch.randn(out.positions.shape, generator=g).to(out.dtype)
    attach_neighbors(out, 6.0)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cached_calls_equal_uncached_to_the_last_bit(layout, dtype):
    model = PMEWrapper(cutoff=6.0, accuracy=1e-5, **LAYOUTS[layout])
    batch = random_charges(two_systems(), seed=2)  # two triclinic cells: one entry each
    if dtype == torch.float32:
        batch = batch.to(dtype=dtype)
    attach_neighbors(batch, 6.0)
    pme.GREEN_CACHE.clear()
    first = _outputs(model, batch)
    assert (pme.GREEN_CACHE.hits, pme.GREEN_CACHE.misses) == (0, 2)
    for step in range(3):  # MD at fixed cell: the atoms move, the Green functions stay
        moved = _moved(batch, seed=step)
        _assert_bit_equal(_outputs(model, moved), _uncached(model, moved), f"{layout}, step {step}")
    assert pme.GREEN_CACHE.hits == 6 and pme.GREEN_CACHE.misses == 2
    _assert_bit_equal(first, _uncached(model, batch), f"{layout}, first call")
    # stress: the strained cell carries a gradient, so no entry is used or made
    _assert_bit_equal(_outputs(model, batch, True), _uncached(model, batch, True), f"{layout}, stress")
    assert pme.GREEN_CACHE.hits == 6 and pme.GREEN_CACHE.misses == 2


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_changed_cell_is_a_new_entry(layout):
    model = PMEWrapper(cutoff=6.0, accuracy=1e-5, mesh_spacing=0.5, **LAYOUTS[layout])
    batch = rock_salt((2, 2, 2), seed=4)
    attach_neighbors(batch, 6.0)
    pme.GREEN_CACHE.clear()
    _outputs(model, batch)
    strained = batch.clone()
    strained.system["cell"] = batch.cell * (1.0 + 1e-12)  # one ulp-scale change: a different key
    strained.node["positions"] = batch.positions * (1.0 + 1e-12)
    attach_neighbors(strained, 6.0)
    _assert_bit_equal(_outputs(model, strained), _uncached(model, strained), f"{layout}, strained cell")
    assert (pme.GREEN_CACHE.hits, pme.GREEN_CACHE.misses) == (0, 2)


def _cached_vs_uncached(rank, world_size, layouts):
    from mlipdd.distributed import DistributedModel, DomainConfig

    results = {}
    for name in layouts:
        model = PMEWrapper(cutoff=6.0, accuracy=1e-5, **LAYOUTS[name])
        dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.5))
        owned = dm.partition(random_charges(rock_salt((3, 2, 2), seed=5), seed=3) if rank == 0 else None)
        pme.GREEN_CACHE.clear()
        pme.GREEN_CACHE.enabled = False
        reference = {k: v.detach().clone() for k, v in dm(owned).items() if k in ("energy", "forces")}
        pme.GREEN_CACHE.enabled = True
        runs = [{k: v.detach().clone() for k, v in dm(owned).items() if k in ("energy", "forces")} for _ in range(3)]
        results[name] = {"equal": all(torch.equal(r[k], reference[k]) for r in runs for k in reference),
                         "hits": pme.GREEN_CACHE.hits, "misses": pme.GREEN_CACHE.misses}
    return results


def test_cached_calls_equal_uncached_under_dd(world_size):
    parts = run_ranks(_cached_vs_uncached, world_size, ("torch", "distributed"), timeout=600)
    for rank, part in enumerate(parts):
        for name, result in part.items():
            assert result["equal"], f"rank {rank}, {name}: cached forces or energy differ"
            assert (result["hits"], result["misses"]) == (2, 1), f"rank {rank}, {name}: {result}"


def test_the_cache_is_bounded():
    cache = pme.GreenCache(size=2)
    cells = [torch.eye(3, dtype=torch.float64) * (10.0 + i) for i in range(3)]
    for cell in cells:
        cache.get(("k",), cell, functools.partial(torch.zeros, 1))
    assert len(cache.entries) == 2 and cache.misses == 3
    cache.get(("k",), cells[0], functools.partial(torch.zeros, 1))  # evicted first: computed again
    assert cache.misses == 4
