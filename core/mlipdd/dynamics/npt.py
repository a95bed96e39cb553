"""Isotropic constant-pressure dynamics: NPT (MTK barostat + Nosé-Hoover chains) and NPH.

Scheme: the isotropic Martyna-Tobias-Klein equations (J. Chem. Phys. 101, 4177 (1994))
with the measure-preserving Trotter split of Tuckerman, Alejandre, López-Rendón,
Jochim & Martyna, J. Phys. A 39, 5629 (2006); the same scheme LAMMPS' ``fix npt iso``
uses. One extra degree of freedom per system, the log-volume strain rate
``v_eps`` (the cell is scaled uniformly, shape kept; anisotropic and fully flexible
cells are not implemented). With ``d = 3`` and ``alpha = 1 + 3 / N_f``::

    dr/dt     = v + v_eps r
    dv/dt     = F/m - alpha v_eps v             (- v_eta1 v with a thermostat)
    dV/dt     = 3 V v_eps
    W dv_eps/dt = alpha sum m v^2 - V tr(stress) - 3 V P_ext   (- W v_xi1 v_eps)

``stress`` is the model's (1/V) dE/d(strain), so ``-tr(stress)/3`` is the virial
pressure. Barostat mass ``W = (N_f + 3) kT pdamp^2``. One step::

    NHC_baro(dt/2) NHC_atoms(dt/2) kick_eps(dt/2) kick_v(dt/2) drift(dt) | forces, stress |
    kick_v(dt/2) kick_eps(dt/2) NHC_atoms(dt/2) NHC_baro(dt/2)

``kick_v`` and ``drift`` are the exact solutions of their linear equations (the
``sinh(x)/x`` factors), so the split is time reversible.

Domain decomposition: the kinetic energy enters through ``reduce`` (two reductions
per step); the stress and energy are already replicated; so ``v_eps`` and the new
cell are bit-identical on every rank, and each rank scales only its owned atoms. The
cell changes every step; the distributed layer notices and rebuilds its halos.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from ase import units

from mlipdd.data import Batch, InputError
from mlipdd.dynamics import reduce as _reduce
from mlipdd.dynamics.base import BaseDynamics
from mlipdd.dynamics.nose_hoover import (
    NoseHooverChain,
    check_positive,
    check_time_constant,
    kinetic2,
    per_system,
    set_chain_settings,
)


def sinh_over_x(x: torch.Tensor) -> torch.Tensor:
    """sinh(x)/x without the 0/0 at x = 0 (series below |x| = 1e-3, error < 1e-19)."""
    small = x.abs() < 1e-3
    safe = torch.where(small, torch.ones_like(x), x)
    x2 = x * x
    return torch.where(small, 1.0 + x2 / 6.0 + x2 * x2 / 120.0, torch.sinh(safe) / safe)


class _IsotropicBarostat(BaseDynamics):
    """The MTK machinery; `NPT` adds the thermostats, `NPH` runs without them."""

    required_fields = ("velocities",)
    compute_stress = True
    thermostatted = False

    def __init__(
        self,
        model,
        dt: float,
        pressure: float | Sequence[float],
        pdamp: float,
        hooks=(),
        *,
        temperature: float | Sequence[float] | None = None,
        tdamp: float | None = None,
        chain_length: int = 3,
        suzuki_yoshida: int = 1,
        removed_dof_per_system: int = 0,
        **kwargs,
    ):
        super().__init__(model, dt, hooks, **kwargs)
        self.pressure_bar = _check_pressure(pressure)
        self.pdamp_fs = check_time_constant(pdamp, "pdamp", "try 1000 time steps")
        self.temperature_K = (
            None
            if temperature is None
            else check_positive(temperature, "temperature", "K", "e.g. 300")
        )
        self.tdamp_fs = (
            None if tdamp is None else check_time_constant(tdamp, "tdamp", "try 100 time steps")
        )
        set_chain_settings(self, chain_length, suzuki_yoshida, removed_dof_per_system)
        # per-system state, built at the first run (it needs the batch)
        self.barostat_velocity: torch.Tensor | None = None  # v_eps, 1 / ASE time unit
        self.barostat_mass: torch.Tensor | None = None  # W, eV (ASE time)^2
        self.external_pressure: torch.Tensor | None = None  # eV / A^3
        self.alpha: torch.Tensor | None = None  # 1 + 3 / N_f
        self.chain: NoseHooverChain | None = None
        self.barostat_chain: NoseHooverChain | None = None
        self._pending_state: dict | None = None

    # ---- setup --------------------------------------------------------------------------
    def setup(self, batch: Batch) -> None:
        if not bool(batch.pbc.all()):
            raise InputError(
                f"{type(self).__name__} changes the volume, which needs a periodic cell along "
                f"all three axes; this batch has pbc {batch.pbc.tolist()}: use NVE / NVT for "
                "slabs, wires and molecules"
            )
        super().setup(batch)
        if "stress" not in self.outputs:
            raise InputError(
                f"{type(self).__name__} needs the stress but {type(self.model).__name__} returned "
                f"only {sorted(self.outputs)} with compute_stress=True; use a model that computes "
                "stress (energy models get it from ModelWrapper's strain route)"
            )
        if self.barostat_velocity is None:
            self._build_state(batch)
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None

    def _build_state(self, batch: Batch) -> None:
        dof = _reduce.degrees_of_freedom(batch, self.reduce, self.removed_dof_per_system)
        kT = self._mass_kT(batch, dof)
        tau_p = self.pdamp_fs * units.fs
        self.alpha = 1.0 + 3.0 / dof
        self.barostat_mass = (dof + 3.0) * kT * tau_p * tau_p
        self.barostat_velocity = torch.zeros_like(kT)
        self.external_pressure = per_system(self.pressure_bar, batch, "pressure") * units.bar
        if self.thermostatted:
            tau_t = self.tdamp_fs * units.fs
            order, length = self.suzuki_yoshida, self.chain_length
            self.chain = NoseHooverChain(kT, dof, tau_t, length, order)
            # the barostat has one degree of freedom per system; its chain follows pdamp
            ones = torch.ones_like(kT)
            self.barostat_chain = NoseHooverChain(kT, ones, tau_p, length, order)

    def _mass_kT(self, batch: Batch, dof: torch.Tensor) -> torch.Tensor:
        """kT that sets the barostat (and chain) masses: the target or starting temperature."""
        if self.temperature_K is not None:
            return units.kB * per_system(self.temperature_K, batch, "temperature")
        kT = kinetic2(batch, self.reduce) / dof
        if not bool((kT > 0).all()):
            raise InputError(
                "NPH sets its barostat mass from the starting kinetic temperature, but a system "
                "starts at rest; pass temperature= (K) to set the mass, or draw velocities first"
            )
        return kT

    # ---- one step -----------------------------------------------------------------------
    def pre_update(self, batch: Batch) -> None:
        k2 = kinetic2(batch, self.reduce)
        if self.thermostatted:
            k2 = self._thermostats(batch, k2)
        self._kick_barostat(batch, k2)
        self._kick_velocities(batch)
        self._drift(batch)

    def post_update(self, batch: Batch) -> None:
        self._kick_velocities(batch)
        k2 = kinetic2(batch, self.reduce)
        self._kick_barostat(batch, k2)
        if self.thermostatted:
            self._thermostats(batch, k2)

    def _thermostats(self, batch: Batch, k2: torch.Tensor) -> torch.Tensor:
        """Both chains by dt/2 (they commute); returns the new 2 KE without a reduction."""
        v_eps = self.barostat_velocity
        scale_eps = self.barostat_chain.half_step(self.barostat_mass * v_eps * v_eps, self.dt)
        self.barostat_velocity = v_eps * scale_eps
        scale = self.chain.half_step(k2, self.dt)
        batch.velocities = batch.velocities * scale[batch.batch].unsqueeze(-1)
        return k2 * scale * scale

    def _kick_barostat(self, batch: Batch, k2: torch.Tensor) -> None:
        volume = torch.linalg.det(batch.cell).abs()
        trace = batch.stress.diagonal(dim1=-2, dim2=-1).sum(-1)
        force = self.alpha * k2 - volume * trace - 3.0 * volume * self.external_pressure
        self.barostat_velocity = (
            self.barostat_velocity + (0.5 * self.dt) * force / self.barostat_mass
        )

    def _kick_velocities(self, batch: Batch) -> None:
        """dv/dt = F/m - alpha v_eps v over dt/2, solved exactly."""
        half = 0.5 * self.dt
        rate = (self.alpha * self.barostat_velocity * half)[batch.batch].unsqueeze(-1)
        accel = batch.forces / batch.atomic_masses.unsqueeze(-1)
        batch.velocities = batch.velocities * torch.exp(-rate) + half * accel * torch.exp(
            -0.5 * rate
        ) * sinh_over_x(0.5 * rate)

    def _drift(self, batch: Batch) -> None:
        """dr/dt = v + v_eps r over dt, solved exactly; the cell scales by exp(v_eps dt)."""
        strain = self.barostat_velocity * self.dt
        per_atom = strain[batch.batch].unsqueeze(-1)
        batch.positions = batch.positions * torch.exp(per_atom) + self.dt * batch.velocities * (
            torch.exp(0.5 * per_atom) * sinh_over_x(0.5 * per_atom)
        )
        batch.cell = batch.cell * torch.exp(strain).view(-1, 1, 1)

    # ---- observables --------------------------------------------------------------------
    def volume(self) -> torch.Tensor:
        """Cell volume per system, A^3."""
        return torch.linalg.det(self.batch.cell).abs()

    def pressure(self) -> torch.Tensor:
        """Instantaneous pressure per system in bar: kinetic (reduced) + virial (model stress)."""
        volume = self.volume()
        kinetic = 2.0 * self.kinetic_energy() / (3.0 * volume)
        virial = -self.batch.stress.diagonal(dim1=-2, dim2=-1).sum(-1) / 3.0
        return (kinetic + virial) / units.bar

    def conserved_energy(self) -> torch.Tensor:
        """E_pot + E_kin + W v_eps^2 / 2 + P_ext V (+ both chains' energies), per system."""
        energy = super().conserved_energy()
        if self.barostat_velocity is None:
            return energy
        v_eps = self.barostat_velocity
        energy = energy + 0.5 * self.barostat_mass * v_eps * v_eps
        energy = energy + self.external_pressure * self.volume()
        if self.thermostatted:
            energy = energy + self.chain.energy() + self.barostat_chain.energy()
        return energy

    # ---- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Step count, barostat velocity and mass (NPT: and both chains), per system."""
        if self.barostat_velocity is None:
            raise InputError(
                f"{type(self).__name__} has no state before its first run; call run() first"
            )
        state = {
            "step_count": self.step_count,
            "barostat_velocity": self.barostat_velocity.clone(),
            # NPH may have taken W from the starting temperature, which a restart cannot see
            "barostat_mass": self.barostat_mass.clone(),
        }
        if self.thermostatted:
            state["thermostat"] = self.chain.state_dict()
            state["barostat_thermostat"] = self.barostat_chain.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict`; before the first run it is applied when the run starts."""
        needed = {"barostat_velocity"} | (
            {"thermostat", "barostat_thermostat"} if self.thermostatted else set()
        )
        if not needed <= set(state):
            raise InputError(
                f"not a {type(self).__name__} state: it lacks {sorted(needed - set(state))}; "
                "pass what state_dict() returned"
            )
        self.step_count = self.target_step = int(state.get("step_count", self.step_count))
        if self.barostat_velocity is None:
            self._pending_state = state
        else:
            self._apply_state(state)

    def _apply_state(self, state: dict) -> None:
        v_eps = torch.as_tensor(state["barostat_velocity"])
        if v_eps.shape != self.barostat_velocity.shape:
            raise InputError(
                f"barostat state is for {v_eps.numel()} systems, the batch has "
                f"{self.barostat_velocity.numel()}; load a checkpoint of the same batch"
            )
        self.barostat_velocity = v_eps.to(self.barostat_velocity).clone()
        if "barostat_mass" in state:
            self.barostat_mass = torch.as_tensor(state["barostat_mass"]).to(v_eps).clone()
        if self.thermostatted:
            self.chain.load_state_dict(state["thermostat"])
            self.barostat_chain.load_state_dict(state["barostat_thermostat"])


class NPT(_IsotropicBarostat):
    """Isothermal-isobaric MD: isotropic MTK barostat with Nosé-Hoover chains (module doc).

    ``temperature`` K and ``pressure`` bar (1 GPa = 10,000 bar), one value or one per
    system; ``tdamp`` and ``pdamp`` fs, one value each (typical: 100 and 1000 time steps).
    ``conserved_energy()`` is the MTK extended energy; ``pressure()`` and ``volume()``
    report the instantaneous values; `state_dict` holds the barostat and both chains.
    """

    thermostatted = True

    def __init__(
        self,
        model,
        dt: float,
        temperature: float | Sequence[float],
        pressure: float | Sequence[float],
        tdamp: float,
        pdamp: float,
        hooks=(),
        **kwargs,
    ):
        if temperature is None or tdamp is None:
            raise InputError(
                "NPT needs a temperature (K) and tdamp (fs); for no thermostat use NPH"
            )
        super().__init__(
            model, dt, pressure, pdamp, hooks, temperature=temperature, tdamp=tdamp, **kwargs
        )


class NPH(_IsotropicBarostat):
    """Isoenthalpic MD: the MTK barostat alone; it conserves H = E + P_ext V + W v_eps^2/2.

    ``pressure`` bar, ``pdamp`` fs. ``temperature`` (K) only sets the barostat mass
    ``W = (N_f + 3) kT pdamp^2``; left out, the starting kinetic temperature is used.
    """

    thermostatted = False

    def __init__(
        self,
        model,
        dt: float,
        pressure: float | Sequence[float],
        pdamp: float,
        hooks=(),
        *,
        temperature: float | Sequence[float] | None = None,
        **kwargs,
    ):
        super().__init__(model, dt, pressure, pdamp, hooks, temperature=temperature, **kwargs)


def _check_pressure(pressure) -> float | list[float]:
    values = [float(p) for p in torch.as_tensor(pressure, dtype=torch.float64).reshape(-1)]
    if not values or not all(math.isfinite(p) for p in values):
        raise InputError(
            f"pressure must be a finite number of bar (one or one per system), got {pressure}"
        )
    return values[0] if len(values) == 1 else values
