"""Strong scaling on CPU ranks: 2 (or more) gloo ranks vs 1 on the same system.

    python benchmarks/scaling_cpu.py [--atoms 8000] [--ranks 1,2] [--threads 1]

Each rank uses ``--threads`` intra-op threads, so the comparison is ranks, not threads.
Times one energy + forces evaluation with the halo already built (median of repeats).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _common import write_results
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.lattices import fcc_argon
from mlipdd.models.lj import LennardJones
from mlipdd.testing import run_ranks
from mlipdd.testing.toy_models import ToyMPNN


def make_model(name):
    if name == "lj":
        return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.5)
    return ToyMPNN(cutoff=5.0, features=32, layers=3, species=(18,))


def timed_forward(rank, world_size, name, batch, repeats):
    model = make_model(name)
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.0))
    owned = dm.partition(batch if rank == 0 else None)
    dm(owned)  # warm-up, builds the halo
    times = []
    for _ in range(repeats):
        if world_size > 1:
            dist.barrier()
        t = time.perf_counter()
        dm(owned)
        if world_size > 1:
            dist.barrier()
        times.append(time.perf_counter() - t)
    return {"median_s": statistics.median(times), "owned": owned.num_atoms,
            "ghosts": dm.strategy.state.plan.n_ghost, "grid": dm.strategy.grid.dims}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--atoms", type=int, default=8000)
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--models", default="lj,mpnn")
    p.add_argument("--name", default="scaling_cpu")
    args = p.parse_args(argv)
    batch = fcc_argon(n_atoms=args.atoms)
    rows = []
    for name in args.models.split(","):
        base = None
        for w in (int(x) for x in args.ranks.split(",")):
            parts = run_ranks(timed_forward, w, name, batch, args.repeats, threads=args.threads, timeout=1800)
            t = max(part["median_s"] for part in parts)
            base = base or t
            rows.append({"model": name, "atoms": batch.num_atoms, "ranks": w, "grid": parts[0]["grid"],
                         "max_ghosts_per_rank": max(part["ghosts"] for part in parts),
                         "forward_ms": t * 1e3, "speedup": base / t, "efficiency": base / t / w})
    table = write_results(args.name, f"CPU strong scaling ({args.threads} thread(s) per rank)", rows,
                          ["model", "atoms", "ranks", "grid", "max_ghosts_per_rank", "forward_ms", "speedup", "efficiency"])
    print(table)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
