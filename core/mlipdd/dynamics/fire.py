"""FIRE energy minimisation (Bitzek et al. 2006) and FIRE 2.0 (Guénolé et al. 2020).

Both are damped MD with a steering rule, run as a `BaseDynamics` so hooks, neighbour
lists and the distributed runtime work unchanged; ``run(batch, max_steps)`` stops
early once every system has max_i |F_i| < ``fmax``.

# NOTE [one reduction per FIRE step]
The steering rule needs v.F, |v| and |F| of each whole system. Each step stacks
every per-atom product it needs into one (n_atoms, k) tensor and reduces it with a
single ``reduce.sum``; FIRE 2.0's |v| after its kick is expanded algebraically
(|v + h F/m|^2 = v.v + 2h v.F/m + h^2 F.F/m^2) so it needs no second round. The
force-norm maximum for the convergence test is one ``reduce.max`` after the force
call. Every control decision (uphill, time step, alpha, converged) is therefore a
function of reduced numbers, identical on every rank, and a run converges in the same
number of steps on any number of ranks.

Differences from ASE's optimizers, which use unit masses and time steps in ASE's
time unit: here the kick is ``dt F/m`` with the real masses (as LAMMPS' ``min_style
fire``) and time steps are in fs. ``max_step`` limits the largest displacement of any
one atom by shrinking the whole step of that system (``max_step_rule="atom"``, as
LAMMPS' ``dmax``); ``"norm"`` limits the norm of the whole system's displacement as
ASE does (an ASE run is reproduced exactly with unit masses, ``dt`` in ASE units and
this rule). Systems of a batch are independent; a system that has converged stops
moving while the others go on. Convergence is tested after each step's force call,
so a run always takes at least one step.
"""

from __future__ import annotations

import torch
from ase import units

from mlipdd.data import Batch, InputError
from mlipdd.dynamics.base import BaseDynamics
from mlipdd.dynamics.reduce import system_sum

MAX_STEP_RULES = ("atom", "norm")


def per_atom(per_system: torch.Tensor, batch: Batch) -> torch.Tensor:
    """A per-system value broadcast to each atom's row, shaped (n_atoms, 1)."""
    return per_system[batch.batch].unsqueeze(-1)


class FIRE(BaseDynamics):
    """The original FIRE (Bitzek, Koskinen, Gähler, Moseler & Gumbsch, PRL 97, 170201).

    Each step, per system, with P = v.F: if P > 0, mix ``v <- (1 - a) v + a |v| F/|F|``
    and, after more than ``n_min`` such steps in a row, grow ``dt`` by ``f_inc`` (up to
    ``dt_max``) and shrink ``a`` by ``f_alpha``; if P <= 0, stop (v = 0), reset ``a``
    to ``alpha_start`` and shrink ``dt`` by ``f_dec``. Then ``v += dt F/m`` and
    ``x += dt v`` (limited by ``max_step``). The very first step only kicks.

    ``dt`` and ``dt_max`` (default 10 dt) in fs, ``fmax`` in eV/A, ``max_step`` in A.
    `state_dict` holds the per-system time step, alpha and counters; the velocities
    live on the batch (they travel with their atoms).
    """

    # the two defaults that differ in FIRE 2.0
    default_n_min = 5
    default_alpha_start = 0.1

    # an optimiser limits its own steps (max_step) and may start from huge forces
    bounds_step_displacement = False

    def __init__(
        self,
        model,
        dt: float = 1.0,
        dt_max: float | None = None,
        fmax: float = 0.05,
        hooks=(),
        *,
        n_min: int | None = None,
        f_inc: float = 1.1,
        f_dec: float = 0.5,
        alpha_start: float | None = None,
        f_alpha: float = 0.99,
        max_step: float = 0.2,
        max_step_rule: str = "atom",
        **kwargs,
    ):
        super().__init__(model, dt, hooks, **kwargs)
        self.dt_max_fs = 10.0 * self.dt_fs if dt_max is None else float(dt_max)
        self.fmax = float(fmax)
        self.n_min = self.default_n_min if n_min is None else int(n_min)
        self.f_inc, self.f_dec, self.f_alpha = float(f_inc), float(f_dec), float(f_alpha)
        self.alpha_start = self.default_alpha_start if alpha_start is None else float(alpha_start)
        self.max_step = float(max_step)
        self.max_step_rule = max_step_rule
        self._check_parameters()
        self.state: dict[str, torch.Tensor] | None = None
        self.max_force: torch.Tensor | None = None  # per system, after the last force call
        self._pending_state: dict | None = None

    def _check_parameters(self) -> None:
        problems = []
        if not self.dt_max_fs >= self.dt_fs:
            problems.append(f"dt_max ({self.dt_max_fs} fs) must be >= dt ({self.dt_fs} fs)")
        if not self.fmax > 0:
            problems.append(f"fmax must be > 0 eV/A, got {self.fmax}; 0.05 is usual")
        if not (self.f_inc >= 1 and 0 < self.f_dec < 1 and 0 < self.f_alpha <= 1):
            problems.append("need f_inc >= 1, 0 < f_dec < 1 and 0 < f_alpha <= 1")
        if not 0 <= self.alpha_start <= 1:
            problems.append(f"alpha_start must lie in [0, 1], got {self.alpha_start}")
        if not self.max_step > 0:
            problems.append(f"max_step must be > 0 A, got {self.max_step}; 0.2 is usual")
        if self.max_step_rule not in MAX_STEP_RULES:
            problems.append(
                f"max_step_rule must be one of {MAX_STEP_RULES}, got {self.max_step_rule!r}"
            )
        if problems:
            raise InputError(f"{type(self).__name__}: " + "; ".join(problems))

    # ---- setup and convergence ----------------------------------------------------------
    def setup(self, batch: Batch) -> None:
        # the same test as BaseDynamics.setup: will the forces be evaluated afresh?
        fresh = batch is not self.batch or batch.forces is None or batch.energy is None
        super().setup(batch)
        if self.state is None:
            restarting = self._pending_state is not None and batch.velocities is not None
            if not restarting:  # a minimisation starts from rest, whatever the batch carries
                batch.velocities = torch.zeros_like(batch.positions)
            self.state = self._initial_state(batch)
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None
        if fresh or self.max_force is None:
            self._measure_forces(batch)

    def _initial_state(self, batch: Batch) -> dict[str, torch.Tensor]:
        n, dtype, device = batch.num_systems, batch.dtype, batch.device
        return {
            "dt": torch.full((n,), self.dt, dtype=dtype, device=device),
            "alpha": torch.full((n,), self.alpha_start, dtype=dtype, device=device),
            "n_downhill": torch.zeros(n, dtype=torch.long, device=device),
            "iterations": torch.zeros(n, dtype=torch.long, device=device),
        }

    def _measure_forces(self, batch: Batch) -> None:
        """Largest |F_i| of each system over all ranks (one reduce.max)."""
        norms = batch.forces.norm(dim=-1)
        local = torch.zeros(batch.num_systems, dtype=norms.dtype, device=norms.device)
        local = local.scatter_reduce(0, batch.batch, norms, reduce="amax", include_self=True)
        self.max_force = self.reduce.max(local)

    def converged_systems(self) -> torch.Tensor:
        return self.max_force < self.fmax

    def converged(self) -> bool:
        """True when every system is below fmax; the same answer on every rank."""
        return bool(self.converged_systems().all())

    def post_update(self, batch: Batch) -> None:
        self._measure_forces(batch)

    # ---- one step -----------------------------------------------------------------------
    def _system_sums(self, batch: Batch, *columns: torch.Tensor) -> torch.Tensor:
        """Several per-atom quantities summed per system in one reduction: (n_systems, k)."""
        return system_sum(batch, torch.stack(columns, dim=-1), self.reduce)

    def pre_update(self, batch: Batch) -> None:
        v, f = batch.velocities, batch.forces
        sums = self._system_sums(batch, (v * f).sum(-1), (v * v).sum(-1), (f * f).sum(-1))
        vf, vv, ff = sums.unbind(-1)
        s = self.state
        active = ~self.converged_systems()
        started = s["iterations"] > 0
        downhill = active & started & (vf > 0)
        uphill = active & started & ~(vf > 0)
        # steer downhill systems towards the force (the current |v|, direction F/|F|)
        v = torch.where(per_atom(downhill, batch), self._mix(batch, v, f, vv, ff), v)
        grow = downhill & (s["n_downhill"] > self.n_min)
        s["dt"] = torch.where(grow, torch.clamp(s["dt"] * self.f_inc, max=self.dt_max), s["dt"])
        s["alpha"] = torch.where(grow, s["alpha"] * self.f_alpha, s["alpha"])
        s["n_downhill"] = torch.where(downhill, s["n_downhill"] + 1, s["n_downhill"])
        # stop uphill systems
        s["dt"] = torch.where(uphill, s["dt"] * self.f_dec, s["dt"])
        s["alpha"] = torch.where(uphill, torch.full_like(s["alpha"], self.alpha_start), s["alpha"])
        s["n_downhill"] = torch.where(uphill, torch.zeros_like(s["n_downhill"]), s["n_downhill"])
        keep = per_atom(active & ~uphill, batch)
        v = torch.where(keep, v, torch.zeros_like(v))
        self._kick_and_move(batch, v, active)

    def _mix(self, batch, v, f, vv, ff) -> torch.Tensor:
        """(1 - a) v + a |v| F/|F| per system; a system with F = 0 keeps v."""
        ratio = torch.where(ff > 0, torch.sqrt(vv / torch.where(ff > 0, ff, 1.0)), 0.0)
        a = torch.where(ff > 0, self.state["alpha"], 0.0)
        return per_atom(1.0 - a, batch) * v + per_atom(a * ratio, batch) * f

    def _kick_and_move(self, batch: Batch, v: torch.Tensor, active: torch.Tensor) -> None:
        """v += dt F/m (active systems), x += dt v limited by max_step; counts the iteration."""
        s = self.state
        dt_atom = per_atom(s["dt"], batch)
        moving = per_atom(active, batch)
        v = torch.where(moving, v + dt_atom * batch.forces / batch.atomic_masses.unsqueeze(-1), v)
        batch.velocities = v
        step = dt_atom * v
        batch.positions = batch.positions + step * per_atom(self._step_limit(batch, step), batch)
        s["iterations"] = torch.where(active, s["iterations"] + 1, s["iterations"])

    def _step_limit(self, batch: Batch, step: torch.Tensor) -> torch.Tensor:
        """Per-system factor <= 1 that keeps the displacement within max_step."""
        if self.max_step_rule == "norm":
            length = torch.sqrt(system_sum(batch, (step * step).sum(-1), self.reduce))
        else:
            norms = step.norm(dim=-1)
            local = torch.zeros(batch.num_systems, dtype=norms.dtype, device=norms.device)
            local = local.scatter_reduce(0, batch.batch, norms, reduce="amax", include_self=True)
            length = self.reduce.max(local)
        too_far = length > self.max_step
        return torch.where(too_far, self.max_step / torch.where(too_far, length, 1.0), 1.0)

    @property
    def dt_max(self) -> float:
        return self.dt_max_fs * units.fs

    # ---- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Step count and the per-system time step (ASE units), alpha and counters."""
        if self.state is None:
            raise InputError(
                f"{type(self).__name__} has no state before its first run; call run() first"
            )
        return {"step_count": self.step_count, **{k: v.clone() for k, v in self.state.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict`; before the first run it is applied when the run starts.

        The velocities are not part of it: they are a per-atom field of the batch.
        """
        missing = {"dt", "alpha", "n_downhill", "iterations"} - set(state)
        if missing:
            raise InputError(
                f"not a {type(self).__name__} state: it lacks {sorted(missing)}; pass what "
                "state_dict() returned"
            )
        self.step_count = self.target_step = int(state.get("step_count", self.step_count))
        if self.state is None:
            self._pending_state = state
        else:
            self._apply_state(state)

    def _apply_state(self, state: dict) -> None:
        for name, current in self.state.items():
            value = torch.as_tensor(state[name])
            if value.shape != current.shape:
                raise InputError(
                    f"{type(self).__name__} state {name!r} is for {value.numel()} systems, the batch "
                    f"has {current.numel()}; load a checkpoint of the same batch"
                )
            self.state[name] = value.to(current).clone()


class FIRE2(FIRE):
    """FIRE 2.0 (Guénolé, Nöhring, Vaid, Houllé, Xie, Prakash & Bitzek, Comput. Mater. Sci.
    175, 109584 (2020)) with the semi-implicit Euler integrator, as LAMMPS' default.

    What changes from `FIRE`: on an uphill step (P <= 0) the system first moves half a
    step back (``x -= dt v / 2``, with the reduced dt) and then stops, and ``dt`` never
    drops below ``dt_min`` (default 0.02 dt); the mixing ``v <- (1 - a) v + a |v| F/|F|``
    is applied on every step *after* the kick ``v += dt F/m``, not before it;
    ``n_min`` (N_delay) defaults to 20 and ``alpha_start`` to 0.25; with
    ``initial_delay`` dt and alpha are not reset by uphill steps during the first
    ``n_min`` iterations. The forces after a step back are not re-evaluated (LAMMPS does
    the same; ASE's FIRE2 evaluates them again). The paper's abort after too many
    uphill steps in a row is left out: ``run``'s step count bounds the run instead.
    """

    default_n_min = 20
    default_alpha_start = 0.25

    def __init__(
        self,
        model,
        dt: float = 1.0,
        dt_max: float | None = None,
        fmax: float = 0.05,
        hooks=(),
        *,
        dt_min: float | None = None,
        initial_delay: bool = True,
        **kwargs,
    ):
        super().__init__(model, dt, dt_max, fmax, hooks, **kwargs)
        self.dt_min_fs = 0.02 * self.dt_fs if dt_min is None else float(dt_min)
        if not 0 < self.dt_min_fs <= self.dt_fs:
            raise InputError(
                f"dt_min must lie in (0, dt], got {self.dt_min_fs} fs; 0.02 dt is usual"
            )
        self.initial_delay = bool(initial_delay)

    def pre_update(self, batch: Batch) -> None:
        v, f = batch.velocities, batch.forces
        inv_m = 1.0 / batch.atomic_masses
        vf_atom, ff_atom = (v * f).sum(-1), (f * f).sum(-1)
        sums = self._system_sums(
            batch, vf_atom, (v * v).sum(-1), ff_atom, vf_atom * inv_m, ff_atom * inv_m * inv_m
        )
        vf, vv, ff, vf_m, ff_m2 = sums.unbind(-1)
        s = self.state
        active = ~self.converged_systems()
        started = s["iterations"] > 0
        downhill = active & started & (vf > 0)
        uphill = active & started & ~(vf > 0)

        s["n_downhill"] = torch.where(downhill, s["n_downhill"] + 1, s["n_downhill"])
        grow = downhill & (s["n_downhill"] > self.n_min)
        s["dt"] = torch.where(grow, torch.clamp(s["dt"] * self.f_inc, max=self.dt_max), s["dt"])
        s["alpha"] = torch.where(grow, s["alpha"] * self.f_alpha, s["alpha"])

        s["n_downhill"] = torch.where(uphill, torch.zeros_like(s["n_downhill"]), s["n_downhill"])
        reset = uphill & (s["iterations"] >= self.n_min) if self.initial_delay else uphill
        dt_min = self.dt_min_fs * units.fs
        s["dt"] = torch.where(reset, torch.clamp(s["dt"] * self.f_dec, min=dt_min), s["dt"])
        s["alpha"] = torch.where(reset, torch.full_like(s["alpha"], self.alpha_start), s["alpha"])
        # half a step back, then stop
        back = per_atom(uphill, batch)
        batch.positions = torch.where(
            back, batch.positions - 0.5 * per_atom(s["dt"], batch) * v, batch.positions
        )
        v = torch.where(back, torch.zeros_like(v), v)
        vv = torch.where(uphill, torch.zeros_like(vv), vv)
        vf_m = torch.where(uphill, torch.zeros_like(vf_m), vf_m)

        # kick, then mix with |v| after the kick, known without another reduction
        h = s["dt"]
        vv_after = torch.clamp(vv + 2.0 * h * vf_m + h * h * ff_m2, min=0.0)
        moving = per_atom(active, batch)
        v = torch.where(moving, v + per_atom(h, batch) * f * inv_m.unsqueeze(-1), v)
        v = torch.where(moving, self._mix(batch, v, f, vv_after, ff), torch.zeros_like(v))
        batch.velocities = v
        step = per_atom(h, batch) * v
        batch.positions = batch.positions + step * per_atom(self._step_limit(batch, step), batch)
        s["iterations"] = torch.where(active, s["iterations"] + 1, s["iterations"])
