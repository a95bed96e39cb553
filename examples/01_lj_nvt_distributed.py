"""Liquid argon (Lennard-Jones), Langevin NVT at 94 K, split over ranks by domain decomposition.

    torchrun --nproc_per_node 2 examples/01_lj_nvt_distributed.py
    python examples/01_lj_nvt_distributed.py            # one rank, same code

Rank 0 builds the system; `DomainParallel` splits it, runs the unchanged integrator on
each rank's atoms and migrates atoms between ranks as they move. The thermo log is
written by rank 0 with globally reduced numbers; the trajectory and the checkpoint are
the full system gathered to rank 0, in atom-id order. Restart with ``--restart``
(on any number of ranks).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlipdd.distributed import (
    CheckpointWriter,
    DistributedManager,
    DomainConfig,
    DomainParallel,
    HookScope,
)
from mlipdd.dynamics import NVTLangevin, ThermoLogger, TrajectoryWriter
from mlipdd.lattices import lj_liquid
from mlipdd.models.lj import LennardJones


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=6, help="FCC cells per axis (4 atoms each)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="lj_nvt_out", help="folder for trajectory and checkpoint")
    parser.add_argument("--restart", action="store_true", help="continue from the checkpoint")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    with DistributedManager() as manager:  # joins torchrun's group, or a 1-rank group
        model = LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.5).to(manager.device)
        dynamics = NVTLangevin(model, dt=5.0, temperature=94.0, friction=0.01, seed=1)
        hooks = [
            ThermoLogger(sys.stdout, frequency=20),  # LOCAL: reduced numbers, printed by rank 0
            # a restart writes a second file: the writer truncates at its first frame
            (TrajectoryWriter(out / f"md{'_restart' if args.restart else ''}.extxyz", frequency=50),
             HookScope.RANK_ZERO),
            CheckpointWriter(out / "state.pt", frequency=100),  # RANK_ZERO by declaration
        ]
        config = DomainConfig(cutoff=model.cutoff, skin=0.5)
        with DomainParallel(dynamics, config, n_steps=args.steps, hooks=hooks) as dp:
            if args.restart:
                owned = dp.restore(out / "state.pt")
            else:
                full = lj_liquid(args.size, temperature=94.0, seed=0) if manager.rank == 0 else None
                owned = dp.partition(full)
            dp.run()
            print(
                f"rank {manager.rank}/{manager.world_size}: owns {owned.num_atoms} atoms after "
                f"step {dp.step_count}, {dp.strategy.rebuilds} halo rebuilds",
                flush=True,
            )


if __name__ == "__main__":
    main()
