"""AIMNet2 (charges + long-range Coulomb) in NVT under sharded domain decomposition.

    torchrun --nproc_per_node 2 examples/10_aimnet2_nvt_sharded.py
    python examples/10_aimnet2_nvt_sharded.py                       # one rank, same code
    torchrun --nproc_per_node 4 examples/10_aimnet2_nvt_sharded.py --model aimnet2.pt

AIMNet2 equilibrates its atomic charges inside the network (a sum over every atom of a
system in each pass) and adds a Coulomb energy reaching beyond the network's 5 A (DSF,
aimnet's periodic setting). Under ``StrategyKind.SHARDED`` each rank stores the atoms it
owns; the per-system sums become a local sum plus an all_reduce and reads of remote
neighbours are fetched from their owners. Without ``--model`` a random-weight model of
the released architecture is used (no download needed); ``--model`` takes an aimnet
v2 ``.pt`` file (its D3 dispersion term is left out: mlipdd-aimnet2 does not compute it).

The script checks one distributed call (energy, forces, charges) against the plain
model on rank 0, then runs Langevin NVT of a periodic molecular crystal with a total
charge of +1 and logs the thermodynamics.
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
from mlipdd.dynamics import NVTLangevin, ThermoLogger, initialize_velocities
from mlipdd_aimnet2.testing import molecular_crystal, random_aimnet2_wrapper
from mlipdd_aimnet2.wrapper import AIMNet2Wrapper


def build_model(path: str | None, dsf_cutoff: float):
    if path is None:
        return random_aimnet2_wrapper(seed=0, dsf_cutoff=dsf_cutoff)
    return AIMNet2Wrapper.from_file(path, dtype=torch.float64, dispersion=False, dsf_cutoff=dsf_cutoff)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="aimnet v2 .pt file (default: random weights)")
    parser.add_argument("--reps", type=int, default=3, help="unit cells per axis (one molecule each)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dsf-cutoff", type=float, default=8.0, help="DSF Coulomb cutoff in A (aimnet: 15)")
    args = parser.parse_args()

    with DistributedManager() as manager:  # joins torchrun's group, or a 1-rank group
        model = build_model(args.model, args.dsf_cutoff)
        config = DomainConfig(cutoff=model.cutoff, skin=0.3, strategy=StrategyKind.SHARDED)
        full = None
        if manager.rank == 0:
            full = Batch.from_data_list([molecular_crystal((args.reps,) * 3, seed=0, charge=1.0)])
            initialize_velocities(full, temperature=300.0, seed=0)

        dm = DistributedModel(model, config)
        owned = dm.partition(full)
        out = dm(owned)
        forces = gather_rows(owned.atom_ids, out["forces"].detach())
        charges = gather_rows(owned.atom_ids, out["charges"].detach())
        print(f"rank {manager.rank}/{manager.world_size}: owns {owned.num_atoms} atoms", flush=True)
        if manager.rank == 0:
            reference = model(full.clone())
            print(f"energy {float(out['energy'][0]):.6f} eV, total charge {float(charges.sum()):+.6f} e")
            print(f"vs one process: |dE| {float((out['energy'] - reference['energy']).abs().max()):.2e} eV, "
                  f"max |dF| {float((forces - reference['forces']).abs().max()):.2e} eV/A, "
                  f"max |dq| {float((charges - reference['charges']).abs().max()):.2e} e", flush=True)

        hooks = [ThermoLogger(sys.stdout, frequency=5)]
        integrator = NVTLangevin(model, dt=0.5, temperature=300.0, friction=0.02, seed=1)
        with DomainParallel(integrator, config, n_steps=args.steps, hooks=hooks) as dp:
            dp.partition(full)
            dp.run()


if __name__ == "__main__":
    main()
