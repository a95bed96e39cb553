"""MACE NPT (isotropic MTK barostat + Nose-Hoover chains) split over ranks.

    torchrun --nproc_per_node 2 examples/06_mace_npt_distributed.py --model my_mace.model
    python examples/06_mace_npt_distributed.py                # one rank, random-weight model

The barostat needs the stress every step. It comes from the strain route:
`MACEWrapper` asks mace for ``(1/V) dE/d(strain)`` (mace differentiates the energy with
respect to a symmetric strain of the cell and positions). Under domain decomposition each
rank's derivative covers the edges it owns; the spec declares the stress a per-rank
partial, so `DistributedModel` all-reduces it and every rank holds the same stress. The
barostat's kinetic energy is reduced too, so every rank scales the cell identically, and
the halo is rebuilt when the cell changes.

``--model`` is a mace ``.model`` file (unpickled: use files you trust); without it a
random-weight MACE (H, C, O) runs on a rattled diamond-carbon supercell. The pressure
and volume are sampled in the LOCAL scope (``dynamics.pressure()`` reduces over ranks,
so every rank must call it; rank 0 prints); thermo log and trajectory are RANK_ZERO.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from mlipdd.distributed import DistributedManager, DomainConfig, DomainParallel, HookScope
from mlipdd.dynamics import (
    NPT,
    DynamicsStage,
    ThermoLogger,
    TrajectoryWriter,
    initialize_velocities,
)
from mlipdd_mace.testing import example_model, example_system


class PressureSampler:
    """Pressure (bar), volume (A^3) and conserved energy every ``frequency`` steps.

    LOCAL scope: ``pressure()`` and ``conserved_energy()`` reduce the kinetic energy over
    the ranks (a collective), so every rank runs this hook and gets the same numbers.
    """

    stage = DynamicsStage.AFTER_STEP
    scope = HookScope.LOCAL

    def __init__(self, frequency: int):
        self.frequency = frequency
        self.rows: list[tuple[float, float, float]] = []

    def __call__(self, ctx, stage) -> None:
        dyn = ctx.dynamics
        self.rows.append(
            (float(dyn.pressure()[0]), float(dyn.volume()[0]), float(dyn.conserved_energy()[0]))
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="mace .model file (default: random-weight MACE)")
    parser.add_argument("--structure", help="starting structure, any ase.io format (last frame)")
    parser.add_argument("--repeat", type=int, default=3, help="diamond cells per axis (8 atoms each)")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"],
                        help="of the random-weight model (a file keeps its own)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dt", type=float, default=0.5, help="fs")
    parser.add_argument("--temperature", type=float, default=300.0, help="K")
    parser.add_argument("--pressure", type=float, default=0.0, help="bar (1 GPa = 10000 bar)")
    parser.add_argument("--tdamp", type=float, default=50.0, help="fs, thermostat time")
    parser.add_argument("--pdamp", type=float, default=500.0, help="fs, barostat time")
    parser.add_argument("--skin", type=float, default=0.5, help="A, Verlet skin of the halo")
    parser.add_argument("--every", type=int, default=10, help="log / frame interval, steps")
    parser.add_argument("--out", default="mace_npt_out", help="folder for the trajectory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with DistributedManager() as manager:
        model = example_model(args.model, args.dtype, manager.device)
        full = None
        if manager.rank == 0:
            full = example_system(args.structure, args.repeat, model.dtype, args.seed)
            if full.velocities is None:
                initialize_velocities(full, args.temperature, seed=args.seed)
            Path(args.out).mkdir(parents=True, exist_ok=True)
        dynamics = NPT(model, dt=args.dt, temperature=args.temperature, pressure=args.pressure,
                       tdamp=args.tdamp, pdamp=args.pdamp)
        sampler = PressureSampler(args.every)
        hooks = [
            sampler,  # LOCAL, declared on the class
            (ThermoLogger(sys.stdout, frequency=args.every), HookScope.RANK_ZERO),
            (TrajectoryWriter(Path(args.out) / "npt.extxyz", frequency=args.every),
             HookScope.RANK_ZERO),
        ]
        config = DomainConfig(cutoff=model.cutoff, skin=args.skin)
        with DomainParallel(dynamics, config, n_steps=args.steps, hooks=hooks) as dp:
            owned = dp.partition(full)
            dp.run()
            stress = owned.stress[0]  # replicated: the same 3x3 on every rank
            n_atoms = dynamics.num_atoms()  # a reduction: every rank calls it
            print(
                f"rank {manager.rank}/{manager.world_size}: {owned.num_atoms} owned atoms, "
                f"{dp.strategy.rebuilds} halo rebuilds, stress trace {float(stress.trace()):.6e} eV/A^3",
                flush=True,
            )
        if manager.rank == 0 and sampler.rows:
            pressure, volume, econs = np.array(sampler.rows).T
            half = len(pressure) // 2
            print(
                f"NPT over {dp.step_count} steps: pressure (second half) {pressure[half:].mean():.0f} "
                f"+- {pressure[half:].std():.0f} bar (target {args.pressure:g}), volume "
                f"{volume[0]:.2f} -> {volume[-1]:.2f} A^3, conserved-energy drift "
                f"{np.ptp(econs) / n_atoms:.1e} eV/atom",
                flush=True,
            )


if __name__ == "__main__":
    main()
