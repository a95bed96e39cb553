"""Charge equilibration under sharded storage: each rank stores only the atoms it owns.

    torchrun --nproc_per_node 2 examples/08_qeq_sharded.py
    python examples/08_qeq_sharded.py            # one rank, same code

`QEqModel` (plain torch) solves for atomic charges inside its forward: a per-system
sum over every atom of a system sits between its two message-passing layers. Under
``StrategyKind.SHARDED`` those sums become a local sum plus an all_reduce, and the
model's reads of neighbouring atoms owned elsewhere are fetched from their owners,
so no rank keeps a ghost shell. Two systems with total charges +1 and -2 run in one
batch.

The script checks one distributed call (energy, forces, charges) against the plain
model on rank 0, prints the rows each rank stores next to what halo storage would
keep, then runs a short NVE under `DomainParallel` with the same strategy.
"""

from __future__ import annotations

import argparse
import sys

import torch
from mlipdd.data import Batch
from mlipdd.distributed import (
    DistributedManager,
    DistributedModel,
    DomainConfig,
    DomainParallel,
    gather_rows,
)
from mlipdd.distributed.config import StrategyKind
from mlipdd.dynamics import NVE, ThermoLogger, initialize_velocities
from mlipdd.testing.qeq_model import QEqModel
from mlipdd.testing.systems import cubic, triclinic


def two_charged_systems(reps: int) -> Batch:
    """An O/H triclinic box (charge +1) and a cubic one (charge -2)."""
    first = triclinic(species=(1, 8), spacing=3.0, reps=reps).to_data_list()[0]
    second = cubic(species=(1, 8), spacing=3.0, reps=reps - 1, seed=3).to_data_list()[0]
    batch = Batch.from_data_list([first, second])
    batch.system["charge"] = torch.tensor([1.0, -2.0], dtype=torch.float64)
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6, help="grid points per axis of the first system")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    with DistributedManager() as manager:  # joins torchrun's group, or a 1-rank group
        model = QEqModel(cutoff=4.5, species=(1, 8))
        config = DomainConfig(cutoff=model.cutoff, skin=0.4, strategy=StrategyKind.SHARDED)
        full = None
        if manager.rank == 0:
            full = two_charged_systems(args.reps)
            initialize_velocities(full, temperature=300.0, seed=0)

        dm = DistributedModel(model, config)
        owned = dm.partition(full)
        out = {k: v.detach() for k, v in dm(owned, compute_stress=True).items()}
        rows = dm.strategy.stored_rows()
        print(f"rank {manager.rank}/{manager.world_size}: stores {rows['owned']} atom rows "
              f"(halo storage would store {rows['owned'] + rows['halo_ghosts']}); reads "
              f"{rows['request_table']} remote atoms per gather", flush=True)

        forces = gather_rows(owned.atom_ids, out["forces"])
        charges = gather_rows(owned.atom_ids, out["charges"])
        if manager.rank == 0:
            reference = {k: v.detach() for k, v in model(full.clone(), compute_stress=True).items()}
            totals = torch.zeros(2, dtype=charges.dtype).index_add(0, full.batch, charges)
            print(f"energy {out['energy'].tolist()} eV, total charges {totals.tolist()}")
            print(f"vs one process: max |dE| {float((out['energy'] - reference['energy']).abs().max()):.2e} eV, "
                  f"max |dF| {float((forces - reference['forces']).abs().max()):.2e} eV/A, "
                  f"max |dq| {float((charges - reference['charges']).abs().max()):.2e} e")

        # a short NVE: the integrator moves owned atoms; migration and rebuilds as for halo
        hooks = [ThermoLogger(sys.stdout, frequency=5)]
        with DomainParallel(NVE(model, dt=0.25), config, n_steps=args.steps, hooks=hooks) as dp:
            dp.partition(full)
            dp.run()


if __name__ == "__main__":
    main()
