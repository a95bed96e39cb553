"""MACE: DistributedModel at 1 rank vs bare mace-torch, and peak memory vs atoms.

    python benchmarks/mace.py --device cuda --sizes 1000,4096,13824,27000,64000 [--medium]
    python benchmarks/mace.py --device cpu --sizes 512,1728 --ranks 1,2

"bare" is the raw mace model called on its own input dict (built once, neighbour list
included); "dd" is `DistributedModel(MACEWrapper(model))` with the halo built, so the
ratio is what domain decomposition costs at one rank (goal <= 1.03 GPU, 1.05 CPU).
With ``--ranks 1,2`` (CPU) it also times 2 spawned gloo ranks on the same system.
Systems are diamond silicon supercells, random-weight models, float32 by default.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

# This file is named like the `mace` package: move its folder behind site-packages.
_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch
from _common import median_time, write_results
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.lattices import silicon_diamond
from mlipdd.neighbors import attach_neighbors
from mlipdd_mace import MACEWrapper
from mlipdd_mace.testing import mace_medium_config, random_mace


def build_model(medium: bool, dtype):
    if medium:
        cfg = mace_medium_config()
        return random_mace(elements=(14,), r_max=cfg["r_max"], num_interactions=cfg["num_interactions"],
                           hidden_irreps=cfg["hidden_irreps"], max_ell=cfg["max_ell"],
                           correlation=cfg["correlation"], dtype=dtype, seed=0)
    return random_mace(elements=(14,), r_max=5.0, channels=32, max_ell=2, correlation=2, dtype=dtype, seed=0)


def si_system(n_atoms: int, dtype, device):
    reps = max(1, round((n_atoms / 8) ** (1 / 3)))
    return silicon_diamond(reps).to(device=device, dtype=dtype)


def one_size(n_atoms, medium, dtype, device, repeats):
    raw = build_model(medium, dtype).to(device).eval()
    wrapper = MACEWrapper(raw).eval()
    batch = si_system(n_atoms, dtype, device)
    attach_neighbors(batch, wrapper.cutoff)
    data = wrapper.adapt_input(batch)
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    row = {"atoms": batch.num_atoms, "device": device, "model": "medium" if medium else "small"}

    def bare():
        data["positions"].requires_grad_(True)
        raw(data, training=False, compute_force=True)

    try:
        row["bare_ms"] = median_time(bare, repeats, sync=sync) * 1e3
        dm = DistributedModel(wrapper, DomainConfig(cutoff=wrapper.cutoff, skin=0.0))
        owned = dm.partition(batch)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        row["dd_1rank_ms"] = median_time(lambda: dm(owned), repeats, sync=sync) * 1e3
        row["ratio"] = row["dd_1rank_ms"] / row["bare_ms"]
        row["atom_steps_per_s"] = batch.num_atoms / row["dd_1rank_ms"] * 1e3
        if device.startswith("cuda"):
            row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError:
        row["note"] = "out of memory"
    finally:
        raw = wrapper = dm = None  # release GPU memory before the next size
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def rank_timing(rank, world_size, n_atoms, medium, dtype_name, repeats):
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    wrapper = MACEWrapper(build_model(medium, dtype)).eval()
    dm = DistributedModel(wrapper, DomainConfig(cutoff=wrapper.cutoff, skin=0.0))
    owned = dm.partition(si_system(n_atoms, dtype, "cpu") if rank == 0 else None)
    dm(owned)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        dm(owned)
        dist.barrier()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="512,1728")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--medium", action="store_true", help="128x0e+128x1o, max_ell 3, correlation 3, 6 A")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ranks", default="1", help="CPU only: also time these rank counts (e.g. 1,2)")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        row = one_size(n, args.medium, dtype, args.device, args.repeats)
        print(row, flush=True)
        rows.append(row)
        if row.get("note") == "out of memory":
            break
    ranks = [int(r) for r in args.ranks.split(",")]
    if args.device == "cpu" and len(ranks) > 1:
        from mlipdd.testing import run_ranks

        for n in (int(s) for s in args.sizes.split(",")):
            base = None
            for w in ranks:
                t = max(run_ranks(rank_timing, w, n, args.medium, args.dtype, args.repeats, timeout=3600))
                base = base or t
                rows.append({"atoms": n, "device": f"cpu x{w} ranks", "model": "medium" if args.medium else "small",
                             "dd_1rank_ms": t * 1e3, "ratio": base / t})
    name = args.name or f"mace_{args.device}"
    table = write_results(name, "MACE: DistributedModel vs bare mace-torch (ratio column: dd/bare, or speedup vs 1 rank for cpu xN rows)",
                          rows, ["atoms", "device", "model", "bare_ms", "dd_1rank_ms", "ratio", "atom_steps_per_s", "peak_GiB", "note"])
    print(table)


if __name__ == "__main__":
    main()
