"""Relax a rattled Lennard-Jones argon crystal with FIRE 2.0, then equilibrate it with NPT.

    python examples/02_lj_fire_then_npt.py
    python examples/02_lj_fire_then_npt.py --size 4 --temperature 60 --pressure 1000

    torchrun --nproc_per_node 2 examples/02_lj_fire_then_npt.py

Both stages are ordinary integrators, each wrapped in `DomainParallel`: FIRE2
minimises until every force is below ``--fmax`` (its convergence test is a reduced
maximum, so all ranks would stop together), then velocities are drawn and NPT (the
isotropic MTK barostat with Nosé-Hoover chains) lets the cell find the volume that
holds ``--pressure`` bar at ``--temperature`` K. Every global quantity both
integrators use goes through ``dynamics.reduce``, which `DomainParallel` replaces by
the cross-rank reducer (see `drive`).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from mlipdd.data import Batch
from mlipdd.distributed import DistributedManager, DomainConfig, DomainParallel, HookScope
from mlipdd.dynamics import FIRE2, NPT, DynamicsStage, ThermoLogger, initialize_velocities
from mlipdd.dynamics.base import BaseDynamics
from mlipdd.lattices import fcc_argon
from mlipdd.models.lj import LennardJones

ARGON = {"epsilon": 0.0104, "sigma": 3.4, "cutoff": 8.5}


def drive(dynamics: BaseDynamics, batch: Batch | None, n_steps: int) -> Batch | None:
    """Run one stage on every rank; returns the full system on rank 0 (None elsewhere).

    `DomainParallel` installs the distributed model and the cross-rank reducer into the
    unchanged integrator, migrates atoms and rebuilds halos when NPT changes the cell.
    """
    config = DomainConfig(cutoff=ARGON["cutoff"], skin=0.5)
    with DomainParallel(dynamics, config, n_steps) as dp:
        dp.partition(batch)
        dp.run()
        return dp.gather()


class Sampler:
    """Pressure, volume and conserved energy every ``frequency`` steps (reduced numbers)."""

    stage = DynamicsStage.AFTER_STEP
    scope = HookScope.LOCAL  # the integrator's pressure() is collective: every rank calls it

    def __init__(self, frequency: int = 10):
        self.frequency = frequency
        self.rows: list[tuple[float, float, float]] = []

    def __call__(self, ctx, stage) -> None:
        dyn = ctx.dynamics
        pressure, volume = dyn.pressure()[0], dyn.volume()[0]
        self.rows.append((float(pressure), float(volume), float(dyn.conserved_energy()[0])))


def rattled_crystal(size: int, rattle: float, seed: int) -> Batch:
    batch = fcc_argon(size)
    noise = np.random.default_rng(seed).normal(0.0, rattle, (batch.num_atoms, 3))
    batch.positions = batch.positions + torch.as_tensor(noise, dtype=batch.dtype)
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=3, help="FCC cells per axis (4 atoms each)")
    parser.add_argument("--rattle", type=float, default=0.1, help="A, random displacement")
    parser.add_argument("--fmax", type=float, default=1e-3, help="eV/A, FIRE stops below it")
    parser.add_argument("--temperature", type=float, default=40.0, help="K")
    parser.add_argument("--pressure", type=float, default=500.0, help="bar")
    parser.add_argument("--steps", type=int, default=600, help="NPT steps of 5 fs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with DistributedManager() as manager:
        root = manager.rank == 0
        model = LennardJones(**ARGON).to(manager.device)
        batch = rattled_crystal(args.size, args.rattle, args.seed) if root else None

        relax = FIRE2(model, dt=2.0, fmax=args.fmax)
        batch = drive(relax, batch, n_steps=2000)
        if root:
            print(
                f"FIRE2 on {manager.world_size} rank(s): "
                f"{'converged' if relax.converged() else 'NOT converged'} after "
                f"{relax.step_count} steps, max force {float(relax.max_force[0]):.2e} eV/A, "
                f"energy {float(relax.batch.energy[0]):.6f} eV",
                flush=True,
            )
            initialize_velocities(batch, args.temperature, seed=args.seed)
        sampler = Sampler(frequency=10)
        npt = NPT(
            model,
            dt=5.0,
            temperature=args.temperature,
            pressure=args.pressure,
            tdamp=100.0,
            pdamp=500.0,
            hooks=[ThermoLogger(sys.stdout, frequency=100), sampler],
        )
        batch = drive(npt, batch, n_steps=args.steps)

        if root:
            pressure, volume, econs = np.array(sampler.rows).T
            half = len(pressure) // 2
            print(
                f"NPT, second half: pressure {pressure[half:].mean():.0f} +- "
                f"{pressure[half:].std():.0f} bar (target {args.pressure:g}), volume "
                f"{volume[half:].mean():.1f} A^3 (started at {volume[0]:.1f}), conserved energy "
                f"drift {np.ptp(econs) / batch.num_atoms:.1e} eV/atom",
                flush=True,
            )

if __name__ == "__main__":
    main()
