"""Load balancing: cut planes that follow the atoms stay exact (1-4 real gloo ranks, float64).

One spawned launch per rank count checks LJ and the 3-layer MPNN on a slab with vacuum
and a half-filled triclinic cell (and charge equilibration under sharded storage); MD
with planes moving at every rebuild equals one process, with every hook scope, and
restarts on another rank count; "time" gives a costlier region fewer atoms.
"""

import functools
import io
import time

import pytest
import torch
from mlipdd.data import InputError
from mlipdd.distributed import DomainConfig, DomainParallel
from mlipdd.dynamics import NVE, ThermoLogger
from mlipdd.models.lj import LennardJones
from mlipdd.strategy.balance import _quantile_cuts, balanced_cuts, load_balance_of
from mlipdd.strategy.grid import RankGrid, halo_targets, plane_spacings
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import check_conformance_cases
from mlipdd.testing.qeq_model import QEqModel
from mlipdd.testing.systems import UNEVEN_CELLS, half_filled, slab
from mlipdd.testing.toy_models import ToyMPNN
from test_domain_parallel import (
    DT,
    GlobalKinetic,
    OwnedIds,
    Snapshots,
    assert_same_frames,
    single_process,
)


def lj():
    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=7.0)


def mpnn():
    return ToyMPNN(cutoff=4.5, layers=3, species=(8, 18))


def qeq():
    return QEqModel(cutoff=4.5, species=(1, 8))


# ---- the grid and the quantiles, in one process ---------------------------------------------
def test_cuts_own_the_right_atoms_and_halo_covers_thin_slabs():
    grid = RankGrid((3, 1, 1), ((0.0, 0.1, 0.15, 1.0), (0.0, 1.0), (0.0, 1.0)))
    frac = torch.tensor([[0.05, 0.5, 0.5], [0.1, 0.5, 0.5], [0.12, 0.2, 0.3], [0.9, 0.1, 0.1]],
                        dtype=torch.float64)
    assert grid.owner(frac).tolist() == [0, 1, 1, 2]
    # a halo 0.2 wide (wider than slab 1, 0.05 thick) reaches across it into slab 2
    width = torch.full((4, 3), 0.2, dtype=torch.float64)
    atom, shift, rank = halo_targets(frac, width, torch.ones(4, 3, dtype=torch.bool), grid)
    reached = {(int(a), int(r)) for a, r, s in zip(atom, rank, shift) if not s.any()}
    assert (0, 2) in reached and (3, 0) not in reached  # 0.05 -> slab 2 starts at 0.15
    wrapped = {(int(a), int(r)) for a, r, s in zip(atom, rank, shift) if s[0] == -1}
    assert (3, 0) in wrapped  # its image at 0.9 - 1 lies within 0.2 of slab 0 (periodic)
    with pytest.raises(InputError, match="non-decreasing"):
        RankGrid((2, 1, 1), ((0.0, 0.7, 0.6), (0.0, 1.0), (0.0, 1.0)))


def test_uniform_cuts_own_like_before():
    frac = torch.rand(500, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    uniform = RankGrid((2, 3, 1))
    explicit = uniform.with_cuts([uniform.bounds(a) for a in range(3)])
    assert torch.equal(uniform.owner(frac), explicit.owner(frac))


def test_quantile_cuts_split_counts_evenly():
    g = torch.Generator().manual_seed(1)
    frac = torch.cat([torch.rand(300, 3, dtype=torch.float64, generator=g) * 0.3,
                      torch.rand(100, 3, dtype=torch.float64, generator=g)])
    cuts = balanced_cuts(frac, None, (4, 2, 1))
    grid = RankGrid((4, 2, 1)).with_cuts(cuts)
    counts = torch.bincount(grid.owner(frac) // 2, minlength=4)  # slabs along a
    assert counts.max() - counts.min() <= 4, counts
    assert cuts[2].tolist() == [0.0, 1.0]
    # weights move the planes: heavy atoms on the left get thinner slabs
    weights = torch.where(frac[:, 0] < 0.5, 3.0, 1.0).double()
    heavy = balanced_cuts(frac, weights, (4, 2, 1))
    assert heavy[0][2] < cuts[0][2]
    # an empty histogram keeps uniform planes
    assert _quantile_cuts(torch.zeros(16, dtype=torch.float64), 4).tolist() == [0, 0.25, 0.5, 0.75, 1]


def test_bad_balance_settings_name_the_fix():
    with pytest.raises(InputError, match="'count' or 'time'"):
        DomainConfig(cutoff=3.0, balance="atoms")
    with pytest.raises(InputError, match="balance_every"):
        DomainConfig(cutoff=3.0, balance="count", balance_every=0)
    with pytest.raises(InputError, match="balance_damping"):
        DomainConfig(cutoff=3.0, balance="time", balance_damping=0.0)
    with pytest.raises(InputError, match="owns atoms by them.*graph_partition does not: use strategy=.halo."):
        DomainConfig(cutoff=3.0, balance="count", strategy="graph_partition")


# ---- conformance with moved planes, 2/3/4 ranks -------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_balanced_planes_are_exact_on_uneven_systems(world_size):
    cases, names = [], []
    for cell, make in UNEVEN_CELLS.items():
        for factory in (lj, mpnn):
            species = (18,) if factory is lj else (8, 18)
            cases.append((factory, make(species=species), {"balance": "count", "skin": 0.3}))
            names.append((cell, factory.__name__))
    # sharded storage owns atoms by the same planes
    cases.append((qeq, slab(species=(1, 8), spacing=3.0), {"balance": "count", "strategy": "sharded"}))
    names.append(("slab", "qeq sharded"))
    if world_size == 4:  # four slabs across the filled half: each thinner than half the shell
        cases.append((lj, half_filled(), {"balance": "count", "skin": 0.3, "grid": (4, 1, 1)}))
        names.append(("half_filled 4x1x1", "lj"))
    thinnest = []  # per case: thinnest slab / halo width
    for (cell, model), (factory, batch, kwargs), (result, parts) in zip(
            names, cases, check_conformance_cases(cases, world_size), strict=True):
        result.assert_close(energy=1e-12, forces=1e-10, stress=1e-10)
        grid = parts[0]["grid"]
        spacing = plane_spacings(batch.cell)[0]
        width = factory().cutoff + kwargs.get("skin", 0.5)
        thinnest.append(min(float(grid.bounds(a).diff().min() * spacing[a]) for a in range(3)) / width)
        assert all(p["grid"] == grid for p in parts), "ranks own by different planes"
        moved = any(grid.bounds(a).tolist() != RankGrid(grid.dims).bounds(a).tolist() for a in range(3))
        assert moved, f"{cell}/{model}: the planes did not move off uniform ({grid})"
        owned = torch.tensor([len(p["atom_ids"]) for p in parts], dtype=torch.float64)
        # count balance along each axis: the per-rank share is even up to one grid row of atoms
        assert owned.max() / owned.mean() < 1.35, f"{cell}/{model}: owned {owned.tolist()}"
        assert parts[0]["imbalance"] == pytest.approx(float(owned.max() / owned.mean()))
    if world_size == 4:  # balanced planes crowd into the matter: a ghost shell spans several slabs
        assert min(thinnest) < 0.6, thinnest


def test_uniform_planes_are_uneven_on_the_same_systems():
    """The premise: without balancing these systems leave ranks nearly empty."""
    for make in (slab, half_filled):
        batch = make()
        from mlipdd.strategy.halo import wrapped_fractional

        owner = RankGrid((4, 1, 1)).owner(wrapped_fractional(batch)) if make is half_filled else \
            RankGrid((1, 1, 4)).owner(wrapped_fractional(batch))
        counts = torch.bincount(owner, minlength=4).double()
        assert counts.max() / counts.mean() > 1.6


# ---- MD while the planes move -------------------------------------------------------------
CUTOFF = 5.5


def film(seed=3):
    """A hot LJ liquid film: periodic box, atoms in the lower 55 % along c (vacuum above)."""
    from mlipdd.lattices import lj_liquid

    batch = lj_liquid(4, temperature=1500.0, seed=seed)
    cell = batch.cell[0].clone()
    cell[2] = cell[2] * 1.8
    batch.system["cell"] = cell[None]
    return batch


def nve(hooks=()):
    return NVE(LennardJones(epsilon=0.0104, sigma=3.4, cutoff=CUTOFF), DT, hooks)


def _balanced_md(rank, world_size, mode, n_steps, path=None, restore=False):
    snaps, owners, kinetic = Snapshots(50), OwnedIds(), GlobalKinetic()
    thermo_out = io.StringIO()
    thermo = ThermoLogger(thermo_out, frequency=20)
    config = DomainConfig(cutoff=CUTOFF, skin=0.5, balance=mode, balance_every=1, balance_damping=0.7)
    with DomainParallel(nve(), config, n_steps, hooks=[snaps, owners, kinetic, thermo]) as dp:
        if restore:
            dp.restore(path)
        else:
            dp.partition(film() if rank == 0 else None)
        dp.run()
        if path is not None and not restore:
            dp.save_checkpoint(path)
        balance = load_balance_of(dp.strategy)
        return {"frames": snaps.frames, "owned_history": owners.history, "kinetic": kinetic.values,
                "history": balance.history, "log": thermo_out.getvalue(), "records": thermo.records}


def _distinct_planes(history):
    return {h["cuts"] for h in history}


MD_STEPS, RESTART_STEPS = 100, 50


@functools.cache
def film_reference() -> dict:
    """One process through the run and its restart (frames every 50 steps), computed once."""
    return single_process("nve", MD_STEPS + RESTART_STEPS, full=film())


@pytest.mark.parametrize(("world_size", "mode"), [(2, "count"), (3, "time"), (4, "time")])
def test_md_with_moving_planes_equals_one_process(world_size, mode, tmp_path):
    n_steps = MD_STEPS
    path = str(tmp_path / "state.pt") if world_size == 2 else None
    results = run_ranks(_balanced_md, world_size, mode, n_steps, path, timeout=300)
    expected = {step: frame for step, frame in film_reference().items() if step <= n_steps}
    assert_same_frames(results[0]["frames"], expected, tol=1e-8)
    history = results[0]["history"]
    assert all(r["history"] == history for r in results), "ranks disagree on the planes"
    print(f"\n{world_size} ranks ({mode}): {len(history)} rebuilds, {len(_distinct_planes(history))} distinct planes")
    assert len(_distinct_planes(history)) >= 3, f"planes hardly moved: {len(_distinct_planes(history))}"
    # every atom owned once at every step (LOCAL hook), GLOBAL hook saw the whole system
    for step in range(n_steps + 1):
        ids = torch.cat([r["owned_history"][step] for r in results])
        assert torch.equal(ids.sort().values, torch.arange(film().num_atoms))
    assert all(n == film().num_atoms for _, n, _, _ in results[0]["kinetic"])
    # the thermo log reports the imbalance at the latest rebuild, only on rank 0
    assert "max/mean" in results[0]["log"] and results[1]["log"] == ""
    assert all(r["imbalance"] >= 1.0 for r in results[0]["records"])
    if mode == "count":
        assert max(h["imbalance"] for h in history[1:]) < 1.1
    if path is not None:  # restart the balanced run on 3 ranks: the trajectory continues
        more = run_ranks(_balanced_md, 3, "count", RESTART_STEPS, path, True, timeout=300)
        frames = more[0]["frames"]
        assert sorted(frames) == [n_steps, n_steps + RESTART_STEPS]
        assert_same_frames(frames, {s: film_reference()[s] for s in frames}, tol=1e-8)


def test_cli_balance_flag_reaches_the_ranks_and_reports_imbalance():
    import json

    from test_domain_parallel import _mlipdd

    done = _mlipdd("run", "--nproc", "2", "--balance", "count", "--steps", "10", "--size", "3",
                   "--log-every", "5", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["max_force_diff_eV_per_A"] < 1e-10 and summary["atoms_conserved"] is True
    assert summary["load_imbalance"] >= 1.0
    assert "owned max/mean" in done.stdout  # the thermo lines carry the column


# ---- "time" follows the measured cost, not the count --------------------------------------
def cold_crystal():
    from mlipdd.lattices import lj_liquid

    return lj_liquid(4, temperature=5.0, seed=1)


class HeavyLeftLJ(LennardJones):
    """LJ whose owned atoms of the left half (by id, from the start) cost extra CPU time:
    a stand-in for an expensive region (a reaction site, a dense cluster)."""

    def __init__(self, seconds_per_heavy_atom=1e-4):
        super().__init__(epsilon=0.0104, sigma=3.4, cutoff=CUTOFF)
        start = cold_crystal()
        left = start.positions[:, 0] < 0.5 * float(start.cell[0, 0, 0])
        self.register_buffer("heavy_ids", start.atom_ids[left])
        self.cost = seconds_per_heavy_atom

    def forward(self, batch, compute_stress=False):
        owned = batch.atom_ids[: getattr(batch, "n_owned", batch.num_atoms)]
        end = time.thread_time() + self.cost * int(torch.isin(owned, self.heavy_ids).sum())
        while time.thread_time() < end:  # CPU work, as a costlier model would do
            pass
        return super().forward(batch, compute_stress)


def _cost_balanced(rank, world_size, n_steps):
    out = {}
    for mode in ("count", "time"):
        # skin 0: every step is a rebuild, so the planes are re-placed at every step
        config = DomainConfig(cutoff=CUTOFF, skin=0.0, grid=(2, 1, 1), balance=mode, balance_every=1)
        with DomainParallel(NVE(HeavyLeftLJ(), DT), config, n_steps) as dp:
            dp.partition(cold_crystal() if rank == 0 else None)
            dp.run()
            out[mode] = {"cut": dp.strategy.grid.bounds(0)[1].item(), "owned": dp.batch.num_atoms}
    return out


def test_time_balance_gives_the_costly_region_fewer_atoms():
    # heavy atoms cost ~4x a light one here: even cost puts the cut near 0.3 of the box
    results = run_ranks(_cost_balanced, 2, 16, timeout=300)
    count, timed = results[0]["count"], results[0]["time"]
    assert abs(count["cut"] - 0.5) < 0.05, count
    assert timed["cut"] < 0.42, timed
    assert results[0]["time"]["owned"] < results[1]["time"]["owned"]
