"""NVE of a 1000-ion NaCl melt (Born-Mayer + PME) on 1 process and on 2 ranks.

The molten_salt model of the ewald_pme plugin (Tosi-Fumi repulsion + PME, Na +1 / Cl -1)
on the built-in ``molten_salt`` box (5^3 rock-salt cells expanded to the melt's density,
1000 ions), velocities at 1200 K, 1 fs steps, float64, 0.5 A Verlet skin. Writes the
energy drift of both runs and the largest position difference between them (by atom id,
unwrapped) to ``results/ewald_pme_nve.md``; fails when that difference exceeds 1e-8 A.

    python benchmarks/ewald_pme_nve.py [--steps 200] [--cells 5]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import write_results

DT_FS, TEMPERATURE, SKIN, CUTOFF = 1.0, 1200.0, 0.5, 7.0


def _system(cells):
    from mlipdd.lattices import molten_salt

    return molten_salt(cells, temperature=TEMPERATURE, seed=0)


def _dynamics(hooks=()):
    from mlipdd.dynamics import NVE
    from mlipdd_ewald_pme.plugin import make_molten_salt

    return NVE(make_molten_salt(cutoff=CUTOFF, accuracy=1e-6), DT_FS, skin=SKIN, hooks=hooks)


class _Final:
    """Unwrapped positions in atom-id order at the end, on rank 0; energy every step."""

    def __init__(self):
        from mlipdd.dynamics import DynamicsStage

        self.stage = (DynamicsStage.BEFORE_RUN, DynamicsStage.AFTER_STEP)
        self.frequency = 1
        self.positions = None
        self.energy: list[float] = []

    def __call__(self, ctx, stage):
        from mlipdd.distributed import unwrapped_positions

        dyn = ctx.dynamics
        self.energy.append(float((dyn.potential_energy() + dyn.kinetic_energy()).sum()))
        order = torch.argsort(ctx.batch.atom_ids)
        self.positions = unwrapped_positions(ctx.batch)[order].clone()


def single(cells, steps):
    torch.set_num_threads(1)
    final = _Final()
    batch = _system(cells)
    start = time.perf_counter()
    _dynamics([final]).run(batch, steps)
    return {"wall": time.perf_counter() - start, "positions": final.positions, "energy": final.energy,
            "atoms": batch.num_atoms}


def _distributed(rank, world_size, cells, steps):
    from mlipdd.distributed import DomainConfig, DomainParallel, HookScope

    final = _Final()
    config = DomainConfig(cutoff=CUTOFF, skin=SKIN)
    with DomainParallel(_dynamics(), config, steps, hooks=[(final, HookScope.RANK_ZERO)]) as dp:
        dp.partition(_system(cells) if rank == 0 else None)
        start = time.perf_counter()
        dp.run()
        wall = time.perf_counter() - start
        return {"wall": wall, "positions": final.positions, "energy": final.energy,
                "rebuilds": dp.strategy.rebuilds, "grid": tuple(dp.strategy.grid.dims)}


def drift_per_atom_ps(energy, atoms, steps):
    """Slope of total energy (least squares) in meV/atom/ps."""
    e = torch.tensor(energy, dtype=torch.float64)
    t = torch.arange(len(e), dtype=torch.float64) * DT_FS / 1000.0
    slope = ((t - t.mean()) * (e - e.mean())).sum() / (t - t.mean()).square().sum()
    return float(slope) * 1000.0 / atoms


def main():
    from mlipdd.testing import run_ranks

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cells", type=int, default=5)
    args = parser.parse_args()
    one = single(args.cells, args.steps)
    two = run_ranks(_distributed, 2, args.cells, args.steps, timeout=3000)[0]
    diff = float((two["positions"] - one["positions"]).abs().max())
    moved = float((one["positions"] - _system(args.cells).positions).norm(dim=1).max())
    rows = []
    for name, run in (("1 process", one), ("2 ranks", two)):
        e = run["energy"]
        rows.append({
            "run": name, "atoms": one["atoms"], "steps": args.steps,
            "s/step": run["wall"] / args.steps,
            "drift meV/atom/ps": drift_per_atom_ps(e, one["atoms"], args.steps),
            "max dE from start meV/atom": max(abs(x - e[0]) for x in e) * 1000.0 / one["atoms"],
            "max dx vs 1 process A": diff if name == "2 ranks" else 0.0,
        })
    notes = (f"2 ranks: grid {two['grid']}, {two['rebuilds']} halo rebuilds; atoms moved up to {moved:.2f} A. "
             "Drift = least-squares slope of total energy. Position difference by atom id, unwrapped.")
    print(write_results("ewald_pme_nve", "NVE NaCl melt, Born-Mayer + PME (1 fs, 1200 K start)", rows,
                        list(rows[0]), notes))
    print(notes)
    assert diff < 1e-8, f"2-rank trajectory differs from one process by {diff:.3g} A"


if __name__ == "__main__":
    main()
