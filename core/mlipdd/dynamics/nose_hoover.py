"""Nosé-Hoover chain thermostat (NVT), and the chain itself for the barostats to reuse.

# NOTE [chain state is global, per system]
A Nosé-Hoover chain is a handful of numbers per system (the positions ``eta_k`` and
velocities ``v_eta_k`` of M fictitious particles). It is driven only by the system's
total kinetic energy, which reaches the chain through ``reduce``; so every rank holds
the same chain and applies the same velocity scale factor to the atoms it owns. The
atoms never need to know where their neighbours live, and the chain never needs a
collective of its own.

Scheme: Martyna, Tuckerman, Tobias & Klein, Mol. Phys. 87, 1117 (1996), as written out
in Tuckerman, Liu, Ciccotti & Martyna, J. Chem. Phys. 115, 1678 (2001): the Trotter
split ``NHC(dt/2) . kick(dt/2) . drift(dt) . [forces] . kick(dt/2) . NHC(dt/2)``, the
chain propagated with Suzuki-Yoshida weights. Masses ``Q_1 = N_f kT tau^2`` and
``Q_k = kT tau^2`` (k > 1), ``tau = tdamp``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from ase import units

from mlipdd.data import Batch, InputError
from mlipdd.dynamics import reduce as _reduce
from mlipdd.dynamics.base import BaseDynamics

# Suzuki-Yoshida weights of order 1, 3, 5 (fourth-order schemes beyond order 1)
_W3 = 1.0 / (2.0 - 2.0 ** (1.0 / 3.0))
_W5 = 1.0 / (4.0 - 4.0 ** (1.0 / 3.0))
SUZUKI_YOSHIDA_WEIGHTS = {
    1: (1.0,),
    3: (_W3, 1.0 - 2.0 * _W3, _W3),
    5: (_W5, _W5, 1.0 - 4.0 * _W5, _W5, _W5),
}


def per_system(value, batch: Batch, name: str) -> torch.Tensor:
    """``value`` (one number or one per system) as a (n_systems,) tensor in the batch dtype."""
    t = torch.as_tensor(value, dtype=batch.dtype, device=batch.device).reshape(-1)
    if t.numel() == 1:
        t = t.expand(batch.num_systems)
    if t.numel() != batch.num_systems:
        raise InputError(
            f"{t.numel()} values of {name} for {batch.num_systems} systems; give one value "
            "or one per system"
        )
    return t.clone()


def check_positive(value, name: str, unit: str, hint: str) -> float | list[float]:
    """One positive finite number or a list of them; the error names the unit and a typical value."""
    values = [float(v) for v in torch.as_tensor(value, dtype=torch.float64).reshape(-1)]
    if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise InputError(
            f"{name} must be > 0 {unit} (one value or one per system), got {value}; {hint}"
        )
    return values[0] if len(values) == 1 else values


def check_time_constant(value, name: str, hint: str) -> float:
    """A damping time in fs: one positive number (the same for every system)."""
    checked = check_positive(value, name, "fs", hint)
    if isinstance(checked, list):
        raise InputError(f"{name} is one time in fs for every system, got {value}; {hint}")
    return checked


def set_chain_settings(dynamics, chain_length: int, suzuki_yoshida: int,
                       removed_dof_per_system: int) -> None:
    """Check and store the Nose-Hoover chain settings shared by NoseHoover and the barostats."""
    if int(chain_length) < 1:
        raise InputError(f"chain_length must be >= 1, got {chain_length}; 3 is usual")
    if suzuki_yoshida not in SUZUKI_YOSHIDA_WEIGHTS:
        raise InputError(
            f"suzuki_yoshida must be one of {sorted(SUZUKI_YOSHIDA_WEIGHTS)}, got {suzuki_yoshida}"
        )
    dynamics.chain_length = int(chain_length)
    dynamics.suzuki_yoshida = int(suzuki_yoshida)
    dynamics.removed_dof_per_system = int(removed_dof_per_system)


class NoseHooverChain:
    """M thermostat particles per system coupled to one kinetic energy (see module NOTE).

    ``kT`` and ``dof`` are (n_systems,) tensors (eV, count); ``tau`` is in ASE time
    units. `half_step` advances the chain by ``dt/2`` and returns the factor by which
    the coupled velocities must be scaled; `energy` is the chain's share of the
    conserved quantity.
    """

    def __init__(self, kT: torch.Tensor, dof: torch.Tensor, tau: float, length: int, order: int):
        if int(length) < 1:
            raise InputError(f"chain_length must be >= 1, got {length}; 3 is usual")
        if order not in SUZUKI_YOSHIDA_WEIGHTS:
            raise InputError(
                f"suzuki_yoshida order must be one of {sorted(SUZUKI_YOSHIDA_WEIGHTS)}, got {order}"
            )
        self.kT = kT
        self.dof = dof
        self.weights = SUZUKI_YOSHIDA_WEIGHTS[order]
        masses = (kT * tau * tau).unsqueeze(-1).repeat(1, int(length))
        masses[:, 0] = masses[:, 0] * dof
        self.masses = masses
        self.positions = torch.zeros_like(masses)
        self.velocities = torch.zeros_like(masses)

    @property
    def length(self) -> int:
        return self.masses.shape[1]

    def _force(self, k: int, kinetic2: torch.Tensor) -> torch.Tensor:
        """Acceleration of link k: link 0 feels 2 KE - N_f kT, link k the link below it."""
        if k == 0:
            return (kinetic2 - self.dof * self.kT) / self.masses[:, 0]
        below = self.masses[:, k - 1] * self.velocities[:, k - 1] ** 2
        return (below - self.kT) / self.masses[:, k]

    def _kick_link(self, k: int, kinetic2: torch.Tensor, delta: float) -> None:
        """v_k += G_k delta/2, damped on both sides by the link above (exact for that part)."""
        accel = self._force(k, kinetic2)
        if k == self.length - 1:
            self.velocities[:, k] = self.velocities[:, k] + 0.5 * delta * accel
            return
        damp = torch.exp(-0.25 * delta * self.velocities[:, k + 1])
        self.velocities[:, k] = (self.velocities[:, k] * damp + 0.5 * delta * accel) * damp

    def half_step(self, kinetic2: torch.Tensor, dt: float) -> torch.Tensor:
        """Advance by dt/2 given 2 KE = sum m v^2 per system; returns the velocity scale."""
        scale = torch.ones_like(kinetic2)
        for weight in self.weights:
            delta = 0.5 * dt * weight
            for k in reversed(range(self.length)):
                self._kick_link(k, kinetic2 * scale * scale, delta)
            # the particles' own part is exact: v -> v exp(-v_eta_1 delta)
            scale = scale * torch.exp(-delta * self.velocities[:, 0])
            self.positions = self.positions + delta * self.velocities
            for k in range(self.length):
                self._kick_link(k, kinetic2 * scale * scale, delta)
        return scale

    def energy(self) -> torch.Tensor:
        """sum_k Q_k v_k^2 / 2 + N_f kT eta_1 + kT sum_{k>1} eta_k, per system (eV)."""
        kinetic = 0.5 * (self.masses * self.velocities**2).sum(-1)
        potential = self.dof * self.kT * self.positions[:, 0]
        potential = potential + self.kT * self.positions[:, 1:].sum(-1)
        return kinetic + potential

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"positions": self.positions.clone(), "velocities": self.velocities.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name in ("positions", "velocities"):
            value = torch.as_tensor(state[name])
            if value.shape != self.masses.shape:
                raise InputError(
                    f"thermostat state {name!r} has shape {tuple(value.shape)} but this chain is "
                    f"{tuple(self.masses.shape)} (systems x chain_length); load a checkpoint "
                    "written for the same batch and chain_length"
                )
            setattr(self, name, value.to(self.masses).clone())


def kinetic2(batch: Batch, reduce) -> torch.Tensor:
    """2 KE = sum_i m_i v_i^2 per system, summed over all ranks."""
    return 2.0 * _reduce.kinetic_energy(batch, reduce)


class NoseHoover(BaseDynamics):
    """NVT with a Nosé-Hoover chain (MTK; see the module docstring).

    ``temperature`` in K (one value or one per system) and ``tdamp`` in fs (one value;
    ~100 dt is a common choice). ``chain_length`` links, propagated with ``suzuki_yoshida`` (1, 3 or
    5) weighted sub-steps (1 is enough while tdamp >> dt; each is a few dozen tiny
    tensor ops, which is what a step's overhead is made of). ``removed_dof_per_system`` degrees of freedom are left out of
    N_f (0 follows ASE's 3N; 3 accounts for a fixed centre of mass).

    One reduction (the kinetic energy) per half step; the chain scale factor is then
    tracked analytically. The chain state is per system and identical on every rank;
    `state_dict` / `load_state_dict` save and restore it. ``conserved_energy()`` is
    potential + kinetic + chain energy.
    """

    required_fields = ("velocities",)

    def __init__(
        self,
        model,
        dt: float,
        temperature: float | Sequence[float],
        tdamp: float,
        chain_length: int = 3,
        hooks=(),
        *,
        suzuki_yoshida: int = 1,
        removed_dof_per_system: int = 0,
        **kwargs,
    ):
        super().__init__(model, dt, hooks, **kwargs)
        self.temperature_K = check_positive(temperature, "temperature", "K", "e.g. 300")
        self.tdamp_fs = check_time_constant(tdamp, "tdamp", "try 100 time steps")
        set_chain_settings(self, chain_length, suzuki_yoshida, removed_dof_per_system)
        self.chain: NoseHooverChain | None = None
        self._pending_state: dict | None = None

    def setup(self, batch: Batch) -> None:
        super().setup(batch)
        if self.chain is None:
            kT = units.kB * per_system(self.temperature_K, batch, "temperature")
            dof = _reduce.degrees_of_freedom(batch, self.reduce, self.removed_dof_per_system)
            tau = self.tdamp_fs * units.fs
            self.chain = NoseHooverChain(kT, dof, tau, self.chain_length, self.suzuki_yoshida)
        if self._pending_state is not None:
            self.chain.load_state_dict(self._pending_state["thermostat"])
            self._pending_state = None

    def _thermostat(self, batch: Batch) -> None:
        scale = self.chain.half_step(kinetic2(batch, self.reduce), self.dt)
        batch.velocities = batch.velocities * scale[batch.batch].unsqueeze(-1)

    def pre_update(self, batch: Batch) -> None:
        self._thermostat(batch)
        accel = batch.forces / batch.atomic_masses.unsqueeze(-1)
        batch.velocities = batch.velocities + (0.5 * self.dt) * accel
        batch.positions = batch.positions + self.dt * batch.velocities

    def post_update(self, batch: Batch) -> None:
        accel = batch.forces / batch.atomic_masses.unsqueeze(-1)
        batch.velocities = batch.velocities + (0.5 * self.dt) * accel
        self._thermostat(batch)

    def conserved_energy(self) -> torch.Tensor:
        energy = super().conserved_energy()
        return energy if self.chain is None else energy + self.chain.energy()

    def state_dict(self) -> dict:
        """Step count and the thermostat chain (positions, velocities: systems x links)."""
        if self.chain is None:
            raise InputError("NoseHoover has no state before its first run; call run() first")
        return {"step_count": self.step_count, "thermostat": self.chain.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict`; before the first run it is applied when the run starts."""
        if "thermostat" not in state:
            raise InputError(
                f"not a NoseHoover state (keys {sorted(state)}); pass what state_dict() returned"
            )
        self.step_count = self.target_step = int(state.get("step_count", self.step_count))
        if self.chain is None:
            self._pending_state = state
        else:
            self.chain.load_state_dict(state["thermostat"])
