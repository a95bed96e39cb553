"""A Verlet list under a changing cell (NPT, NPH): kept while it provably holds every
pair within the cutoff (NOTE [skin under strain] in mlipdd.neighbors), rebuilt otherwise.
Issue 24 item 6: NPT/NPH rebuilt the list every step (31 builds in 30 steps), because any
change of the cell counted as invalidating it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from mlipdd.dynamics import NPH, NPT
from mlipdd.lattices import lj_liquid
from mlipdd.models.lj import LennardJones
from mlipdd.neighbors import NeighborListPolicy, build_neighbor_list

CUTOFF = 6.0


def _lj():
    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=CUTOFF)


def _pairs(batch, cutoff) -> set[tuple[int, int, tuple[int, ...]]]:
    nl = build_neighbor_list(batch, cutoff)
    vec = (batch.positions[nl.edge_index[1]] + nl.unit_shifts.to(batch.dtype) @ batch.cell[0]
           - batch.positions[nl.edge_index[0]])
    keep = vec.norm(dim=1) < cutoff
    return {(int(i), int(j), tuple(s.tolist())) for i, j, s, k
            in zip(nl.edge_index[0], nl.edge_index[1], nl.unit_shifts, keep) if k}


def test_a_kept_list_holds_every_pair_after_random_strain_and_moves():
    """Whenever the policy keeps its list, every pair within the cutoff is in it."""
    gen = torch.Generator().manual_seed(3)
    kept = 0
    for trial in range(40):
        batch = lj_liquid(3, temperature=None, seed=trial)
        policy = NeighborListPolicy(CUTOFF, skin=1.0)
        listed = policy.build(batch)
        listed_pairs = {(int(i), int(j), tuple(s.tolist())) for i, j, s
                        in zip(listed.edge_index[0], listed.edge_index[1], listed.unit_shifts)}
        scale = 0.03 * (trial % 8 + 1)
        strain = torch.eye(3, dtype=batch.dtype) + scale * (torch.rand(3, 3, generator=gen, dtype=batch.dtype) - 0.5)
        batch.cell = batch.cell @ strain
        batch.positions = batch.positions @ strain + 0.5 * scale * torch.randn(
            batch.positions.shape, generator=gen, dtype=batch.dtype)
        if policy.needs_rebuild(batch):
            continue
        kept += 1
        assert _pairs(batch, CUTOFF) <= listed_pairs, f"trial {trial}: a pair within the cutoff is missing"
    assert 5 <= kept < 40  # both answers were given: small strains keep the list, large ones do not


def test_a_uniform_compression_by_more_than_the_skin_allows_rebuilds():
    batch = lj_liquid(3, temperature=None, seed=0)
    policy = NeighborListPolicy(CUTOFF, skin=0.6)
    policy.build(batch)
    # s_min = 0.95: (6.6 - 6 / 0.95) / 2 = 0.14 A allowed; atoms sit still in the scaled frame
    for factor, rebuild in ((0.995, False), (0.95, False), (0.90, True)):
        moved = lj_liquid(3, temperature=None, seed=0)
        moved.cell = moved.cell * factor
        moved.positions = moved.positions * factor
        assert policy.needs_rebuild(moved) is rebuild, factor


def test_npt_and_nph_rebuild_rarely_and_equal_a_run_that_rebuilds_every_step():
    for make in (lambda m, hooks=(), skin=1.0: NPT(m, 2.0, 94.0, 5000.0, 100.0, 200.0, hooks, skin=skin),
                 lambda m, hooks=(), skin=1.0: NPH(m, 2.0, 5000.0, 200.0, hooks, skin=skin)):
        runs = {}
        for skin in (1.0, None):  # None: no kept list, the model builds a fresh one every call
            batch = lj_liquid(3, temperature=94.0, seed=1)
            dyn = make(_lj(), skin=skin)
            energies = []
            dyn.setup(batch)
            for _ in range(30):
                dyn.step()
                energies.append(float(dyn.potential_energy().sum()))
            builds = sum(h.num_builds for h in dyn.hooks if hasattr(h, "num_builds"))
            runs[skin] = (torch.tensor(energies, dtype=torch.float64), batch.cell.clone(), builds)
        (e_skin, cell_skin, builds), (e_fresh, cell_fresh, fresh_builds) = runs[1.0], runs[None]
        assert not torch.equal(cell_skin, lj_liquid(3, temperature=None, seed=1).cell)  # it moved
        torch.testing.assert_close(e_skin, e_fresh, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cell_skin, cell_fresh, rtol=1e-12, atol=1e-12)
        assert fresh_builds == 0 and 1 <= builds <= 6, (builds, fresh_builds)


def test_npt_on_two_ranks_rebuilds_rarely_too():
    result = subprocess.run(
        [sys.executable, "-m", "mlipdd", "run", "--size", "3", "--steps", "30", "--log-every", "0",
         "--progress", "off", "--device", "cpu", "--ensemble", "npt", "--nproc", "2", "--json"],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["neighbor_list_builds"] <= 6
