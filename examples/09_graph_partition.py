"""Graph partition: a model that builds its own graph, split by nodes across ranks.

    torchrun --nproc_per_node 2 examples/09_graph_partition.py
    python examples/09_graph_partition.py            # one rank, same code

`GraphBuildingMPNN` builds its radius graph inside forward, as UMA does, so there is
no neighbour list to pad with a halo. Under ``StrategyKind.GRAPH_PARTITION`` every rank
sees the full geometry and owns a contiguous block of atoms; the model keeps the edges
of its owned receivers and all-gathers node features once per layer through
`mlipdd.shard.graph_partition` (identity in one process).

The script checks one distributed force call against the one-process model on rank 0,
then runs a short NVE under `DomainParallel` with the same strategy.
"""

from __future__ import annotations

import argparse
import sys

import torch
from mlipdd.distributed import (
    DistributedManager,
    DistributedModel,
    DomainConfig,
    DomainParallel,
    gather_rows,
)
from mlipdd.distributed.config import StrategyKind
from mlipdd.dynamics import NVE, ThermoLogger
from mlipdd.lattices import fcc_argon
from mlipdd.testing.graph_building_model import GraphBuildingMPNN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4, help="FCC cells per axis (4 atoms each)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    with DistributedManager() as manager:  # joins torchrun's group, or a 1-rank group
        model = GraphBuildingMPNN(cutoff=4.5, species=(18,))
        config = DomainConfig(cutoff=model.cutoff, strategy=StrategyKind.GRAPH_PARTITION)
        full = None
        if manager.rank == 0:
            torch.manual_seed(0)
            full = fcc_argon(args.size, temperature=40.0, seed=0)
            full.positions = full.positions + 0.05 * torch.randn(full.positions.shape, dtype=full.dtype)

        # one force call, checked against the plain model on rank 0
        dm = DistributedModel(model, config)
        owned = dm.partition(full)
        out = dm(owned, compute_stress=True)
        forces = gather_rows(owned.atom_ids, out["forces"])
        print(f"rank {manager.rank}/{manager.world_size}: owns atoms {owned.atom_ids[0]}..{owned.atom_ids[-1]}, "
              f"energy {float(out['energy'][0]):.6f}")
        if manager.rank == 0:
            reference = model(full.clone(), compute_stress=True)
            df = float((forces - reference["forces"]).abs().max())
            ds = float((out["stress"] - reference["stress"]).abs().max())
            print(f"vs one process: max |dF| {df:.2e} eV/A, max |dstress| {ds:.2e}")

        # a short NVE with the same strategy: the integrator runs on the owned atoms
        hooks = [ThermoLogger(sys.stdout, frequency=5)]
        with DomainParallel(NVE(model, dt=2.0), config, n_steps=args.steps, hooks=hooks) as dp:
            dp.partition(full)
            dp.run()


if __name__ == "__main__":
    main()
