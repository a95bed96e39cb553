"""Integrators: NVE (velocity Verlet) and NVTLangevin (BAOAB).

Both are strictly per-atom inside ``pre_update``/``post_update``, so they are exact
under domain decomposition; the only global sum (the Langevin bath's energy ledger)
goes through ``self.reduce``. New ensembles (Nose-Hoover, NPT, FIRE) subclass
`BaseDynamics` the same way and route their global sums through
`mlipdd.dynamics.reduce`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from ase import units

from mlipdd.data import Batch, InputError
from mlipdd.dynamics.base import BaseDynamics
from mlipdd.dynamics.random import STREAM_LANGEVIN, hash_normal
from mlipdd.dynamics.reduce import system_sum


def _accelerations(batch: Batch) -> torch.Tensor:
    return batch.forces / batch.atomic_masses.unsqueeze(-1)


class NVE(BaseDynamics):
    """Velocity Verlet: kick dt/2, drift dt | forces | kick dt/2. Same as ASE's VelocityVerlet."""

    required_fields = ("velocities",)

    def pre_update(self, batch: Batch) -> None:
        batch.velocities = batch.velocities + (0.5 * self.dt) * _accelerations(batch)
        batch.positions = batch.positions + self.dt * batch.velocities

    def post_update(self, batch: Batch) -> None:
        batch.velocities = batch.velocities + (0.5 * self.dt) * _accelerations(batch)


class NVTLangevin(BaseDynamics):
    """Langevin dynamics with the BAOAB splitting (Leimkuhler & Matthews, 2013).

    One step: B (kick dt/2), A (drift dt/2), O (exact Ornstein-Uhlenbeck update
    ``v <- c1 v + sqrt((1 - c1^2) kT/m) xi`` with ``c1 = exp(-friction dt)``), A (drift
    dt/2) | forces | B (kick dt/2). BAOAB samples configurations with a small,
    time-step-robust error and reduces to velocity Verlet at zero friction.

    ``temperature`` in K (one value, or one per system); ``friction`` in 1/fs (0.01 /fs
    = 10 /ps is a gentle thermostat for liquids). The noise ``xi`` of an atom at step
    ``n`` is a pure function of (seed, n, atom id) (`mlipdd.dynamics.random`), so the
    trajectory is the same however the atoms are ordered or split across ranks.

    ``bath_energy`` (per system, eV) is the heat the thermostat has taken out of the
    system; ``conserved_energy()`` = potential + kinetic + bath_energy stays flat up
    to the integration error, which makes it the drift measure for NVT runs. Keeping
    that ledger costs one per-system reduction per step; ``track_bath_energy=False``
    skips it.
    """

    required_fields = ("velocities",)
    state_fields = ("step_count", "bath_energy")  # the noise needs no state: seed + step

    def __init__(
        self,
        model,
        dt: float,
        temperature: float | Sequence[float],
        friction: float = 0.01,
        seed: int = 0,
        hooks=(),
        *,
        track_bath_energy: bool = True,
        **kwargs,
    ):
        super().__init__(model, dt, hooks, **kwargs)
        friction = float(friction)
        if not (friction >= 0 and math.isfinite(friction)):
            raise InputError(f"friction must be >= 0 (in 1/fs), got {friction}; try 0.01")
        self.friction_per_fs = friction
        self.temperature_K = _check_temperature(temperature)
        self.seed = int(seed)
        self.track_bath_energy = track_bath_energy
        self.bath_energy: torch.Tensor | None = None

    def _kT_per_atom(self, batch: Batch) -> torch.Tensor:
        t = torch.as_tensor(self.temperature_K, dtype=batch.dtype, device=batch.device).reshape(-1)
        if t.numel() == 1:
            t = t.expand(batch.num_systems)
        elif t.numel() != batch.num_systems:
            raise InputError(
                f"{t.numel()} temperatures for {batch.num_systems} systems; give one value or "
                "one per system"
            )
        return (units.kB * t)[batch.batch]

    def pre_update(self, batch: Batch) -> None:
        half = 0.5 * self.dt
        v = batch.velocities + half * _accelerations(batch)
        x = batch.positions + half * v
        v_after = self._ornstein_uhlenbeck(batch, v)
        if self.track_bath_energy:
            self._account_heat(batch, v, v_after)
        batch.velocities = v_after
        batch.positions = x + half * v_after

    def post_update(self, batch: Batch) -> None:
        batch.velocities = batch.velocities + (0.5 * self.dt) * _accelerations(batch)

    def _ornstein_uhlenbeck(self, batch: Batch, v: torch.Tensor) -> torch.Tensor:
        c1 = math.exp(-self.friction_per_fs * self.dt_fs)
        c2 = math.sqrt(max(0.0, 1.0 - c1 * c1))
        if c2 == 0.0:
            return v
        sigma = torch.sqrt(self._kT_per_atom(batch) / batch.atomic_masses).unsqueeze(-1)
        xi = hash_normal(self.seed, STREAM_LANGEVIN, self.step_count, batch.atom_ids, 3)
        return c1 * v + c2 * sigma * xi.to(device=v.device, dtype=v.dtype)

    def _account_heat(self, batch: Batch, v_before: torch.Tensor, v_after: torch.Tensor) -> None:
        m = batch.atomic_masses
        delta = 0.5 * m * ((v_before**2).sum(-1) - (v_after**2).sum(-1))
        heat = system_sum(batch, delta, self.reduce)
        self.bath_energy = heat if self.bath_energy is None else self.bath_energy + heat

    def conserved_energy(self) -> torch.Tensor:
        energy = super().conserved_energy()
        return energy if self.bath_energy is None else energy + self.bath_energy


def _check_temperature(temperature) -> float | list[float]:
    values = [float(t) for t in torch.as_tensor(temperature, dtype=torch.float64).reshape(-1)]
    if not values or any(not (t >= 0 and math.isfinite(t)) for t in values):
        raise InputError(
            f"temperature must be >= 0 K (one value or one per system), got {temperature}"
        )
    return values[0] if len(values) == 1 else values
