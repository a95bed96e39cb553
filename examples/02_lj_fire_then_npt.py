"""Relax a rattled Lennard-Jones argon crystal with FIRE 2.0, then equilibrate it with NPT.

    python examples/02_lj_fire_then_npt.py
    python examples/02_lj_fire_then_npt.py --size 4 --temperature 60 --pressure 1000

Single process for now. Both stages are ordinary integrators on one `Batch`: FIRE2
minimises until every force is below ``--fmax`` (its convergence test is a reduced
maximum, so all ranks would stop together), then velocities are drawn and NPT (the
isotropic MTK barostat with Nosé-Hoover chains) lets the cell find the volume that
holds ``--pressure`` bar at ``--temperature`` K. Every global quantity both
integrators use goes through ``dynamics.reduce``, so the only change domain
decomposition needs is in `drive` below (marked).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from mlipdd.data import Batch
from mlipdd.dynamics import FIRE2, NPT, DynamicsStage, ThermoLogger, initialize_velocities
from mlipdd.dynamics.base import BaseDynamics
from mlipdd.lattices import fcc_argon
from mlipdd.models.lj import LennardJones

ARGON = {"epsilon": 0.0104, "sigma": 3.4, "cutoff": 8.5}


def drive(dynamics: BaseDynamics, batch: Batch, n_steps: int) -> Batch:
    """Run one stage; returns the (full) system afterwards."""
    # ==== DOMAIN DECOMPOSITION GOES HERE =================================================
    # Single process: the integrator sees the whole batch. Under torchrun this becomes a
    # DomainParallel around `dynamics` (it installs the distributed reducer and model and
    # rebuilds halos when NPT changes the cell), roughly:
    #     with DomainParallel(dynamics, DomainConfig(cutoff=..., skin=0.5)) as dp:
    #         dp.partition(batch if rank == 0 else None)
    #         dp.run(n_steps)
    #         batch = dp.gather()          # full system on rank 0, None elsewhere
    # The hooks below then need their scopes (the samplers are collective: LOCAL).
    dynamics.run(batch, n_steps)
    return batch
    # ======================================================================================


class Sampler:
    """Pressure, volume and conserved energy every ``frequency`` steps (reduced numbers)."""

    stage = DynamicsStage.AFTER_STEP

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

    model = LennardJones(**ARGON)
    batch = rattled_crystal(args.size, args.rattle, args.seed)

    relax = FIRE2(model, dt=2.0, fmax=args.fmax)
    batch = drive(relax, batch, n_steps=2000)
    print(
        f"FIRE2: {'converged' if relax.converged() else 'NOT converged'} after "
        f"{relax.step_count} steps, max force {float(relax.max_force[0]):.2e} eV/A, "
        f"energy {float(batch.energy[0]):.6f} eV",
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
