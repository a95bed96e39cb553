"""What sharded storage's owned rows cost around a forward (QEqModel, forward + forces + stress).

    python benchmarks/sharded_owned_rows.py [--ranks 2] [--repeats 15]

The spatial strategies enter a torch-function mode around every forward (`CountedReductions`:
NOTE [aten means], NOTE [a single row], NOTE [contraction order]); the rows themselves are
aten-level ShardTensors. Two measurements:

* in one process, CPU time of a plain `QEqModel` forward + forces + stress: bare, inside
  `CountedReductions` (on plain tensors every op passes through it: the mode's Python call
  per op), and inside a pass-through torch-function mode (the floor of any such mode).
  CPU time, interleaved, so that a loaded machine blurs the numbers less than wall time would;
* on ``--ranks`` gloo ranks, wall time of the sharded forward of `QEqModel` (owned rows,
  reads routed to their owners) and of the halo one (``[owned | ghost]`` rows), interleaved.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from _common import median_time, write_results
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.neighbors import attach_neighbors
from mlipdd.shard.aten.counted import CountedReductions
from mlipdd.spec import HaloStoragePolicy
from mlipdd.testing import run_ranks
from mlipdd.testing.qeq_model import QEqModel
from mlipdd.testing.systems import triclinic
from torch.overrides import TorchFunctionMode

SPECIES = (1, 8)


class _PassThroughMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def one_process(reps: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    batch = triclinic(species=SPECIES, spacing=3.0, reps=reps)
    model = QEqModel(cutoff=4.5, species=SPECIES)
    attach_neighbors(batch, model.cutoff)
    variants = {"bare": contextlib.nullcontext, "counted_mode": CountedReductions,
                "function_mode": _PassThroughMode}
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, context in variants.items():
            start = time.process_time()
            for _ in range(3):
                with context():
                    model(batch, compute_stress=True)
            times[name].append((time.process_time() - start) / 3)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"where": "1 process, CPU time", "atoms": batch.num_atoms, "bare_ms": ms["bare"],
            "counted_mode_ms": ms["counted_mode"], "function_mode_ms": ms["function_mode"],
            "counted_overhead": ms["counted_mode"] / ms["bare"] - 1,
            "mode_overhead": ms["function_mode"] / ms["bare"] - 1}


def _ranks_worker(rank, world_size, batch, repeats):
    calls = {}
    for strategy in ("sharded", "halo"):
        model = QEqModel(cutoff=4.5, species=SPECIES)
        spec = model.distribution_spec()  # QEq's spec is sharded; the same one on halo rows
        spec = spec if strategy == "sharded" else spec.replace(policy=HaloStoragePolicy())
        dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, strategy=strategy), spec=spec)
        owned = dm.partition(batch if rank == 0 else None)
        calls[strategy] = lambda dm=dm, owned=owned: dm(owned, compute_stress=True)
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(median_time(call, 1, warmup=1))
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def on_ranks(ranks: int, reps: int, repeats: int) -> dict:
    batch = triclinic(species=SPECIES, spacing=3.0, reps=reps)
    ms = run_ranks(_ranks_worker, ranks, batch, repeats, timeout=1200)[0]
    return {"where": f"{ranks} gloo ranks, wall time", "atoms": batch.num_atoms, "halo_ms": ms["halo"],
            "sharded_ms": ms["sharded"], "sharded_vs_halo": ms["sharded"] / ms["halo"] - 1}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    rows = [one_process(reps, args.repeats) for reps in (4, 6)]
    rows.append(on_ranks(args.ranks, 6, args.repeats))
    table = write_results(
        "sharded_owned_rows", "Sharded storage: the forward's torch-function mode and routed reads (QEqModel, "
        "forward + forces + stress)",
        rows, ["where", "atoms", "bare_ms", "counted_mode_ms", "function_mode_ms", "counted_overhead",
               "mode_overhead", "halo_ms", "sharded_ms", "sharded_vs_halo"],
        notes="float64, 1 thread per process. `counted_mode`: the spatial strategies. `CountedReductions` around "
              "a plain forward; `function_mode`: a pass-through TorchFunctionMode (the floor of any such mode). "
              "On a shared machine read differences below ~5 % (CPU time) / ~15 % (wall time) as noise.",
    )
    print(table)


if __name__ == "__main__":
    main()
