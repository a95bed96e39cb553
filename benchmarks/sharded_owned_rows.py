"""Cost of inferring owned rows under sharded storage (NOTE [row counts], mlipdd.shard.owned_rows).

    python benchmarks/sharded_owned_rows.py [--ranks 2] [--repeats 15]

The sharded strategy wraps torch's factories while a forward runs, so that per-atom
tensors created from the atom count are owned rows (NOTE [patched factories]). Two
measurements of what that costs:

* in one process, CPU time of a plain `QEqModel` forward + forces + stress: bare,
  inside the scope (factories wrapped on entry, given back on exit), and with a
  pass-through torch-function mode (the design not
  taken: it puts a Python call in front of every op). CPU time, interleaved, so that a
  loaded machine blurs the numbers less than wall time would;
* on ``--ranks`` gloo ranks, wall time of the sharded forward of `QEqModel` (which
  needs no inference) with and without the scope, interleaved.
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
from mlipdd.shard import ExchangePlan, ShardMeta, owned_rows
from mlipdd.strategy import ShardedStrategy
from mlipdd.testing import run_ranks
from mlipdd.testing.qeq_model import QEqModel
from mlipdd.testing.systems import triclinic
from torch.overrides import TorchFunctionMode

SPECIES = (1, 8)


class _PassThroughMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _wrapped_factories():
    """What a sharded forward runs in, less the layout (no RowCount reaches a factory)."""
    return owned_rows.owned_rows_scope(_ONE_RANK_META)


_ONE_RANK_META = ShardMeta(ExchangePlan(torch.zeros(0, dtype=torch.long), (0,), (0,), -1), n_systems=1)


def one_process(reps: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    batch = triclinic(species=SPECIES, spacing=3.0, reps=reps)
    model = QEqModel(cutoff=4.5, species=SPECIES)
    attach_neighbors(batch, model.cutoff)
    variants = {"bare": contextlib.nullcontext, "wrapped_factories": _wrapped_factories,
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
            "wrapped_factories_ms": ms["wrapped_factories"], "function_mode_ms": ms["function_mode"],
            "wrapped_overhead": ms["wrapped_factories"] / ms["bare"] - 1,
            "mode_overhead": ms["function_mode"] / ms["bare"] - 1}


class _WithoutScope(ShardedStrategy):
    def model_scope(self, meta):
        return contextlib.nullcontext()


def _ranks_worker(rank, world_size, batch, repeats):
    model = QEqModel(cutoff=4.5, species=SPECIES)
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, strategy="sharded"))
    owned = dm.partition(batch if rank == 0 else None)
    with_scope, without = [], []
    for _ in range(repeats):
        with_scope.append(median_time(lambda: dm(owned, compute_stress=True), 1, warmup=1))
        dm.strategy.__class__ = _WithoutScope
        without.append(median_time(lambda: dm(owned, compute_stress=True), 1, warmup=1))
        dm.strategy.__class__ = ShardedStrategy
    return statistics.median(with_scope) * 1e3, statistics.median(without) * 1e3


def on_ranks(ranks: int, reps: int, repeats: int) -> dict:
    batch = triclinic(species=SPECIES, spacing=3.0, reps=reps)
    with_ms, without_ms = run_ranks(_ranks_worker, ranks, batch, repeats, timeout=1200)[0]
    return {"where": f"{ranks} gloo ranks, wall time", "atoms": batch.num_atoms, "bare_ms": without_ms,
            "wrapped_factories_ms": with_ms, "wrapped_overhead": with_ms / without_ms - 1}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    rows = [one_process(reps, args.repeats) for reps in (4, 6)]
    rows.append(on_ranks(args.ranks, 6, args.repeats))
    table = write_results(
        "sharded_owned_rows", "Sharded storage: cost of inferring owned rows (QEqModel, forward + forces + stress)",
        rows, ["where", "atoms", "bare_ms", "wrapped_factories_ms", "function_mode_ms", "wrapped_overhead",
               "mode_overhead"],
        notes="float64, 1 thread per process. `function_mode` is the design not taken (a pass-through "
              "TorchFunctionMode around the forward). Measured on a shared 2-core machine under heavy "
              "load from other jobs: read differences below ~5 % (CPU time) / ~15 % (wall time) as noise.",
    )
    print(table)


if __name__ == "__main__":
    main()
