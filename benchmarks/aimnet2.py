"""AIMNet2 on CPU ranks: forward time and peak memory, sharded vs halo storage, 1/2/4 ranks.

    python benchmarks/aimnet2.py [--reps 7,7,7] [--ranks 1,2,4] [--dsf-cutoff 15] [--repeats 2]

A random-weight AIMNet2 in the released architecture (`mlipdd_aimnet2.testing`,
2.2 M parameters, 5 A network cutoff), float32 as aimnet runs it, with DSF Coulomb
(aimnet's periodic default: alpha 0.2, 15 A) on a periodic triclinic crystal of
methanol-like molecules (reps = unit cells per axis, 6 atoms each; 7,7,7 -> 2058 atoms).
One "forward" is energy + forces + stress + charges. Each rank uses one intra-op thread.
Memory: the per-rank resident peak of one call above the resident memory before it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch
from _common import peak_and_wall, write_results
from mlipdd.testing import run_ranks


def system(reps):
    from mlipdd.data import Batch
    from mlipdd_aimnet2.testing import molecular_crystal

    return Batch.from_data_list([molecular_crystal(reps, seed=0, dtype=torch.float32)])


def measure(rank, world_size, reps, strategy, dsf_cutoff, repeats):
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: freed tensors leave the process
    except OSError:
        pass
    from mlipdd.distributed import DistributedModel, DomainConfig
    from mlipdd_aimnet2.testing import random_aimnet2_wrapper

    model = random_aimnet2_wrapper(seed=0, dtype=torch.float32, dsf_cutoff=dsf_cutoff)
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, strategy=strategy))
    owned = dm.partition(system(reps) if rank == 0 else None)

    def call():
        return dm(owned, compute_stress=True)

    measured = peak_and_wall(call, repeats, world_size)
    rows = dm.last_padded.positions.shape[0]
    return {**measured, "owned": owned.num_atoms, "model_rows": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", default="7,7,7", help="unit cells per axis (6 atoms each)")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--strategies", default="sharded,halo")
    p.add_argument("--dsf-cutoff", type=float, default=15.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--name", default="aimnet2_cpu")
    args = p.parse_args(argv)
    os.environ.setdefault("MLIPDD_SPAWN_PRELOAD", "aimnet.models,aimnet.modules.lr,mlipdd_aimnet2.wrapper")
    reps = tuple(int(r) for r in args.reps.split(","))
    n_atoms = 6 * reps[0] * reps[1] * reps[2]
    load = os.getloadavg()[0]
    rows = []
    for strategy in args.strategies.split(","):
        base = None
        for world_size in (int(w) for w in args.ranks.split(",")):
            parts = run_ranks(measure, world_size, reps, strategy, args.dsf_cutoff, args.repeats, timeout=3000)
            row = {"atoms": n_atoms, "strategy": strategy, "ranks": world_size,
                   "forward_s": max(r["best_s"] for r in parts),
                   "model_rows_per_rank": max(r["model_rows"] for r in parts),
                   "peak_mb_per_rank": max(r["peak_mb"] for r in parts)}
            base = base or row
            row["speedup"] = base["forward_s"] / row["forward_s"]
            row["peak_vs_1"] = row["peak_mb_per_rank"] / base["peak_mb_per_rank"]
            rows.append(row)
            print(row, flush=True)
    notes = (
        f"Random-weight AIMNet2 (released architecture, 2.2 M parameters), float32, DSF Coulomb alpha 0.2 / "
        f"{args.dsf_cutoff} A (network cutoff 5 A), energy + forces + stress + charges per call; periodic "
        f"triclinic crystal of methanol-like molecules, {n_atoms} atoms; 1 intra-op thread per rank; gloo. "
        "forward_s: wall time, best of the repeats, slowest rank. model_rows_per_rank: the atom rows the "
        "network runs on at the busiest rank (sharded: owned atoms; halo: owned + ghost atoms). "
        f"peak_mb_per_rank: resident peak of one call above the memory before it. Load average at start: "
        f"{load:.1f} on {os.cpu_count()} cores, a machine shared with other jobs: 4 ranks on 2 cores cannot "
        "run 4x faster, and times are noisy; rows and memory are not."
    )
    table = write_results(args.name, "AIMNet2 on CPU ranks: sharded vs halo storage", rows,
                          ["atoms", "strategy", "ranks", "forward_s", "speedup", "model_rows_per_rank",
                           "peak_mb_per_rank", "peak_vs_1"], notes)
    print(table)


if __name__ == "__main__":
    sys.exit(main())
