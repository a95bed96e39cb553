"""MACE Langevin NVT split over ranks by domain decomposition.

    torchrun --nproc_per_node 2 examples/03_mace_nvt_distributed.py --model my_mace.model
    python examples/03_mace_nvt_distributed.py                # one rank, random-weight model
    python examples/03_mace_nvt_distributed.py --structure start.extxyz --model my_mace.model

``--model`` is a mace ``.model`` file (``torch.save`` of a MACE / ScaleShiftMACE module,
as mace's training writes; loading unpickles code, so use files you trust). Without it a
small random-weight MACE (H, C, O) is built, which is enough to see the machinery run.
The starting structure is ``--structure`` (anything ase.io reads) or, by default, a
rattled diamond-carbon supercell.

The wrapper and the integrator are the single-process ones; `DomainParallel` wraps the
integrator, splits the system and migrates atoms between ranks. The thermo log and the
trajectory are hooks on the outer `DomainParallel` in the RANK_ZERO scope: the full
system is gathered to rank 0 (atom-id order) and only rank 0 writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlipdd.distributed import DistributedManager, DomainConfig, DomainParallel, HookScope
from mlipdd.dynamics import NVTLangevin, ThermoLogger, TrajectoryWriter, initialize_velocities
from mlipdd_mace.testing import example_model, example_system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="mace .model file (default: random-weight MACE)")
    parser.add_argument("--structure", help="starting structure, any ase.io format (last frame)")
    parser.add_argument("--repeat", type=int, default=3, help="diamond cells per axis (8 atoms each)")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"],
                        help="of the random-weight model (a file keeps its own)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dt", type=float, default=0.5, help="fs")
    parser.add_argument("--temperature", type=float, default=300.0, help="K")
    parser.add_argument("--skin", type=float, default=0.5, help="A, Verlet skin of the halo")
    parser.add_argument("--every", type=int, default=10, help="log / frame interval, steps")
    parser.add_argument("--out", default="mace_nvt_out", help="folder for the trajectory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with DistributedManager() as manager:  # joins torchrun's group, or makes a 1-rank one
        model = example_model(args.model, args.dtype, manager.device)
        full = None
        if manager.rank == 0:  # only rank 0 reads or builds the system
            full = example_system(args.structure, args.repeat, model.dtype, args.seed)
            if full.velocities is None:
                initialize_velocities(full, args.temperature, seed=args.seed)
            Path(args.out).mkdir(parents=True, exist_ok=True)
        dynamics = NVTLangevin(model, dt=args.dt, temperature=args.temperature,
                               friction=0.01, seed=args.seed)
        hooks = [
            (ThermoLogger(sys.stdout, frequency=args.every), HookScope.RANK_ZERO),
            (TrajectoryWriter(Path(args.out) / "md.extxyz", frequency=args.every),
             HookScope.RANK_ZERO),
        ]
        config = DomainConfig(cutoff=model.cutoff, skin=args.skin)
        with DomainParallel(dynamics, config, n_steps=args.steps, hooks=hooks) as dp:
            owned = dp.partition(full)
            dp.run()
            print(
                f"rank {manager.rank}/{manager.world_size} ({manager.device}): owns "
                f"{owned.num_atoms} atoms after {dp.step_count} steps, grid "
                f"{tuple(dp.strategy.grid.dims)}, {dp.strategy.rebuilds} halo rebuilds",
                flush=True,
            )


if __name__ == "__main__":
    main()
