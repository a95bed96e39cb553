"""Cost of inferring owned rows under sharded storage (NOTE [row counts], mlipdd.shard.owned_rows).

    python benchmarks/sharded_owned_rows.py [--ranks 2] [--reps 6] [--repeats 7]

The sharded strategy runs the model's forward inside a torch-function mode that turns
per-atom tensors created from the atom count into owned rows. `QEqModel` derives every
per-atom tensor from an input and needs no mode, so timing it with and without the mode
(interleaved, on the same ranks) measures the mode's overhead alone; `ChargeMPNN`
(``torch.zeros(n_atoms)`` charges) is shown beside it for scale.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
from _common import median_time, write_results
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.strategy import ShardedStrategy
from mlipdd.testing import run_ranks
from mlipdd.testing.ordinary_models import ChargeMPNN
from mlipdd.testing.qeq_model import QEqModel
from mlipdd.testing.systems import triclinic

SPECIES = (1, 8)


def _worker(rank, world_size, batch, repeats):
    rows = []
    for name, model in (("QEqModel", QEqModel(cutoff=4.5, species=SPECIES)), ("ChargeMPNN", ChargeMPNN())):
        dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, strategy="sharded"))
        owned = dm.partition(batch if rank == 0 else None)
        plain = type("WithoutMode", (ShardedStrategy,), {"model_scope": lambda self, meta: contextlib.nullcontext()})
        with_mode, without = [], []
        for _ in range(repeats):
            with_mode.append(median_time(lambda: dm(owned, compute_stress=True), 1, warmup=1))
            if name == "QEqModel":  # needs no mode: the overhead alone
                dm.strategy.__class__ = plain
                without.append(median_time(lambda: dm(owned, compute_stress=True), 1, warmup=1))
                dm.strategy.__class__ = ShardedStrategy
        row = {"model": name, "atoms": batch.num_atoms, "ranks": world_size,
               "with_mode_ms": statistics.median(with_mode) * 1e3}
        if without:
            row["without_mode_ms"] = statistics.median(without) * 1e3
            row["overhead"] = row["with_mode_ms"] / row["without_mode_ms"] - 1.0
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    batch = triclinic(species=SPECIES, spacing=3.0, reps=args.reps)
    rows = run_ranks(_worker, args.ranks, batch, args.repeats, timeout=1200)[0]
    table = write_results(
        "sharded_owned_rows", "Sharded storage: forward + forces + stress with and without the owned-rows mode",
        rows, ["model", "atoms", "ranks", "with_mode_ms", "without_mode_ms", "overhead"],
        notes=f"float64, gloo on CPU, 1 thread per rank; torch {torch.__version__}. Shared machine: "
              "other jobs ran at the same time, so read the overhead as an order of magnitude.",
    )
    print(table)


if __name__ == "__main__":
    main()
