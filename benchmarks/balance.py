"""Load balancing on CPU: uniform cut planes vs ``balance="count"`` vs ``balance="time"``.

Two uneven LJ argon systems (epsilon 0.0104 eV, sigma 3.4 A, cutoff 8.5 A, skin 0.3 A,
NVE, 5 fs, 94 K, float64), each on 2 and 4 spawned gloo ranks, one thread per rank:

* ``slab``: an FCC slab filling the lower half of the cell along z, vacuum above it
  (pbc False along z);
* ``droplet``: a sphere of FCC argon (radius 0.4 of the box) centred at 0.3 of the box
  along each axis, in a periodic cubic box.

Placed off-centre on purpose: a system symmetric about the cell's middle is split evenly
by uniform planes at 2 ranks already.

Per run: ``warmup`` untimed steps (the "time" balancer adapts there, re-balancing at
every rebuild), then ``steps`` timed steps. Reported: owned atoms per rank max/mean at
the last rebuild; force-work imbalance = max/mean over ranks of the main thread's CPU
time in the timed steps (waiting in a collective costs no CPU time, so this is the work
each rank did); wall time per step of the slowest rank.

    python benchmarks/balance.py [--cells 10] [--steps 60] [--warmup 30] [--ranks 2,4]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import write_results

EPSILON, SIGMA, CUTOFF, SKIN = 0.0104, 3.4, 8.5, 0.3
LATTICE, DT_FS, TEMPERATURE = 5.26, 5.0, 94.0
MODES = (None, "count", "time")


def _rebuilt(positions, cell, pbc):
    from mlipdd.data import AtomicData, Batch
    from mlipdd.dynamics.velocities import initialize_velocities

    data = AtomicData(positions=positions, atomic_numbers=torch.full((positions.shape[0],), 18),
                      cell=cell, pbc=pbc, dtype=torch.float64)
    batch = Batch.from_data_list([data])
    initialize_velocities(batch, TEMPERATURE, 0)
    return batch


def slab(cells: int):
    """FCC argon slab of ``cells``^3 unit cells at the bottom of a cell twice as tall (50 % vacuum)."""
    from mlipdd.lattices import fcc_argon

    bulk = fcc_argon(cells, a=LATTICE, temperature=None)
    cell = bulk.cell[0].clone()
    positions = bulk.positions.clone()
    positions[:, 2] += 0.25 * LATTICE  # off the bottom face: non-periodic atoms stay inside
    cell[2] = 2 * cell[2]
    return _rebuilt(positions, cell, (True, True, False))


def droplet(cells: int):
    """A sphere of FCC argon, radius 0.4 of the box edge, centred at 0.3 of the box, in a
    periodic box of ``1.6 * cells`` unit cells (about a quarter of the box filled)."""
    from mlipdd.lattices import fcc_argon

    n = round(1.6 * cells)
    bulk = fcc_argon(n, a=LATTICE, temperature=None)
    cell = bulk.cell[0].clone()
    centre = 0.5 * cell.sum(0)
    keep = (bulk.positions - centre).norm(dim=1) < 0.4 * float(cell[0, 0])
    positions = bulk.positions[keep] - 0.2 * cell.sum(0)  # centre at 0.3: wraps across faces
    frac = positions @ torch.linalg.inv(cell)
    return _rebuilt((frac - frac.floor()) @ cell, cell, True)


SYSTEMS = {"slab": slab, "droplet": droplet}


def _rank(rank, world_size, system, cells, mode, warmup, steps):
    import torch.distributed as dist
    from mlipdd.distributed import DomainConfig, DomainParallel
    from mlipdd.dynamics import NVE
    from mlipdd.models.lj import LennardJones
    from mlipdd.strategy.balance import load_balance_of

    dyn = NVE(LennardJones(epsilon=EPSILON, sigma=SIGMA, cutoff=CUTOFF), DT_FS)
    config = DomainConfig(cutoff=CUTOFF, skin=SKIN, balance=mode, balance_every=1)
    with DomainParallel(dyn, config) as dp:
        owned = dp.partition(SYSTEMS[system](cells) if rank == 0 else None)
        dyn.setup(owned)
        dp.run(warmup)
        dist.barrier()
        wall, cpu = time.perf_counter(), time.thread_time()
        dp.run(steps)
        cpu = time.thread_time() - cpu
        dist.barrier()
        wall = time.perf_counter() - wall
        history = load_balance_of(dp.strategy).history
        return {"wall": wall, "cpu": cpu, "imbalance": history[-1]["imbalance"], "owned": history[-1]["owned"],
                "rebuilds": len(history), "grid": dp.strategy.grid.dims, "atoms": int(dyn.num_atoms()),
                "etot": float(dyn.conserved_energy().sum())}


def _work_summary(rows: list[dict]) -> str:
    """One line: the range of 'work max/mean' per balance mode over all runs."""
    parts = []
    for mode in ("off", "count", "time"):
        work = [r["work max/mean"] for r in rows if r["balance"] == mode]
        owned = [r["owned max/mean"] for r in rows if r["balance"] == mode]
        parts.append(f"{mode}: work max/mean {min(work):.2f}-{max(work):.2f}, owned {min(owned):.2f}-{max(owned):.2f}")
    return "Over these runs, " + "; ".join(parts) + "."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--ranks", default="2,4")
    args = parser.parse_args()
    from mlipdd.testing import run_ranks

    rows = []
    for system in SYSTEMS:
        for ranks in (int(r) for r in args.ranks.split(",")):
            for mode in MODES:
                parts = run_ranks(_rank, ranks, system, args.cells, mode, args.warmup, args.steps,
                                  timeout=1800, threads=1)
                cpu = torch.tensor([p["cpu"] for p in parts])
                row = {
                    "system": system, "atoms": parts[0]["atoms"], "ranks": ranks,
                    "grid": "x".join(map(str, parts[0]["grid"])), "balance": mode or "off",
                    "owned max/mean": parts[0]["imbalance"], "owned": "/".join(map(str, parts[0]["owned"])),
                    "work max/mean": float(cpu.max() / cpu.mean()),
                    "ms/step": 1000 * max(p["wall"] for p in parts) / args.steps,
                    "rebuilds": parts[0]["rebuilds"], "etot": parts[0]["etot"],
                }
                rows.append(row)
                print(row, flush=True)
    columns = ["system", "atoms", "ranks", "grid", "balance", "owned max/mean", "owned", "work max/mean",
               "ms/step", "rebuilds"]
    notes = (f"`python benchmarks/balance.py --cells {args.cells} --steps {args.steps} --warmup {args.warmup} "
             f"--ranks {args.ranks}`. LJ argon, cutoff {CUTOFF} A, skin {SKIN} A, float64, one thread per "
             "rank, balance_every=1. The CPU is shared with other engineers' jobs (and 4 ranks run on "
             "fewer cores than ranks), so ms/step is noisy; 'owned' and 'work max/mean' (per-rank CPU time "
             "of the timed steps, max/mean) are the robust columns (ms/step mostly measures the load).\n\n"
             + _work_summary(rows))
    print(write_results("balance", "Load balancing: uniform vs count vs time cut planes (LJ, CPU)", rows,
                        columns, notes))


if __name__ == "__main__":
    main()
