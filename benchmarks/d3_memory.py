"""D3(BJ) memory and time per call, chunked C6 blocks vs all edges at once (NOTE [chunked D3 pairs]).

Rattled rock salt (NaCl, 8 n^3 atoms: 97,336 at n=23, 1,000,000 at n=50), D3 two-body at a
10 A cutoff, energy + forces + stress per call, neighbour list prebuilt. Each row: the peak
memory of one call above what was held before it (CUDA: max_memory_allocated; CPU: the
profiler's running sum of allocations and frees, a lower bound), the median call time, and
`D3Wrapper.memory_estimate` for the same edge count. ``--chunks 0``: one chunk of all edges.

    python benchmarks/d3_memory.py --device cpu --reps 8,12 --out benchmarks/results
    python benchmarks/d3_memory.py --device cuda --reps 23,50 --dtype float32 --out $OUT
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import median_time, write_results


def _batch(reps: int, dtype, device):
    from mlipdd.neighbors import attach_neighbors
    from mlipdd_ewald_pme.testing import rock_salt

    batch = rock_salt((reps, reps, reps), rattle=0.1, skew=False, seed=reps).to(dtype=dtype, device=device)
    attach_neighbors(batch, 10.0)
    return batch


def _peak_gib(call, device) -> float:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = call()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:  # the allocator's own count (RSS hides what the heap reuses): the running sum of every
        # op's allocations minus frees, in the order the ops ran
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = call()
        held = peak = 0
        for event in sorted(prof.events(), key=lambda e: e.time_range.start):
            held += event.self_cpu_memory_usage
            peak = max(peak, held)
    del out
    return peak / 2**30


def row(reps: int, chunk: int, dtype, device, repeats: int) -> dict:
    from mlipdd_ewald_pme.d3 import D3Wrapper

    batch = _batch(reps, dtype, device)
    edges = batch.neighbors.num_edges
    model = D3Wrapper(cutoff=10.0, chunk=chunk or edges).to(device)

    def call():
        out = model(batch, compute_stress=True)
        return {k: v.detach() for k, v in out.items()}

    sync = torch.cuda.synchronize if device.type == "cuda" else None
    call()  # warm-up
    peak = _peak_gib(call, device)
    seconds = median_time(call, repeats=repeats, warmup=0, sync=sync)
    estimate = D3Wrapper.memory_estimate(batch.num_atoms, edges, dtype, chunk=chunk or edges) / 2**30
    return {"atoms": batch.num_atoms, "edges": edges, "chunk": chunk or "all", "dtype": str(dtype).split(".")[-1],
            "seconds": seconds, "peak_GiB": peak, "estimate_GiB": estimate, "peak/estimate": peak / estimate,
            "bytes/edge": peak * 2**30 / edges}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", default="8,12", help="rock-salt repetitions n (8 n^3 atoms), comma-separated")
    parser.add_argument("--chunks", default="0,524288", help="edges per C6 block; 0: all edges at once")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows, start = [], time.perf_counter()
    for reps in (int(r) for r in args.reps.split(",")):
        for chunk in (int(c) for c in args.chunks.split(",")):
            try:
                rows.append(row(reps, chunk, dtype, device, args.repeats))
            except torch.OutOfMemoryError:
                rows.append({"atoms": 8 * reps**3, "chunk": chunk or "all", "skipped": "out of memory"})
            print(rows[-1], flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    name = args.name or f"d3_memory_{device.type}"
    how = ("torch.cuda.max_memory_allocated" if device.type == "cuda" else
           "the CPU profiler's running sum of each op's net allocations: a LOWER bound, since what an op allocates "
           "and frees inside itself (the C6 op's chunk blocks, say) is not seen")
    notes = (f"{args.device}, {args.dtype}, D3(BJ) two-body, 10 A cutoff, rattled rock salt, energy + forces + "
             f"stress per call (median of {args.repeats} after a warm-up). peak: above what was held before the call "
             f"(the batch and its neighbour list), from {how}. estimate: `D3Wrapper.memory_estimate`. "
             f"Total {time.perf_counter() - start:.0f} s.")
    columns = ["atoms", "edges", "chunk", "dtype", "seconds", "peak_GiB", "estimate_GiB", "peak/estimate",
               "bytes/edge", "skipped"]
    print(write_results(name, "D3 memory per call, chunked C6 blocks", rows, columns, notes, args.out))


if __name__ == "__main__":
    main()
