"""The integrator skeleton: stages, hooks, and the velocity-Verlet split.

One MD step, as `BaseDynamics.step` runs it::

    BEFORE_STEP
    pre_update(batch)        # first half kick + drift (integrator specific)
    AFTER_POSITIONS
    compute()                # BEFORE_COMPUTE, model forward, AFTER_COMPUTE
    post_update(batch)       # second half kick (integrator specific)
    AFTER_STEP               # step counter already advanced

`run` adds BEFORE_RUN (after the initial force evaluation) and AFTER_RUN around the
loop, and ON_CONVERGE when an optimiser's `converged` says stop.

Units are ASE's: eV, Angstrom, amu, and ASE's internal time unit. The user gives the
time step in fs; ``self.dt`` holds it in ASE units (``dt_fs * ase.units.fs``), so
velocities are the same numbers ``Atoms.get_velocities()`` returns.

Integrators written on this base stay exact under domain decomposition as long as
``pre_update``/``post_update`` are per-atom and every sum over atoms goes through
``self.reduce`` (see `mlipdd.dynamics.reduce`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from ase import units

from mlipdd.data import Batch, InputError, check_not_empty
from mlipdd.dynamics import reduce as _reduce
from mlipdd.dynamics import stop as _stop
from mlipdd.dynamics.reduce import GlobalReducer

DEFAULT_SKIN = 0.5  # Angstrom, for the neighbour-list hook added automatically
MAX_STEP_DISPLACEMENT = 1.0  # Angstrom per step: beyond it the run has blown up


class BlowUpError(InputError):
    """The system blew up (non-finite energy, atoms flying off); raised on every rank."""

    raised_on_every_rank = True  # the check is reduced over ranks first


class DynamicsStage(enum.Enum):
    BEFORE_RUN = "before_run"
    BEFORE_STEP = "before_step"
    AFTER_POSITIONS = "after_positions"
    BEFORE_COMPUTE = "before_compute"
    AFTER_COMPUTE = "after_compute"
    AFTER_STEP = "after_step"
    ON_CONVERGE = "on_converge"
    AFTER_RUN = "after_run"


# Stages that fire once per `run`; a hook's frequency does not thin them out.
ONCE_PER_RUN = frozenset(
    {DynamicsStage.BEFORE_RUN, DynamicsStage.AFTER_RUN, DynamicsStage.ON_CONVERGE}
)


@runtime_checkable
class DynamicsHook(Protocol):
    """Anything with ``stage`` (one stage or several), ``frequency`` and ``__call__``.

    A hook fires at its stage(s) on steps where ``step % frequency == 0``; ``step`` is
    the number of completed steps at AFTER_STEP and the index of the step being taken
    at the earlier stages.
    """

    stage: DynamicsStage | tuple[DynamicsStage, ...]
    frequency: int

    def __call__(self, ctx: HookContext, stage: DynamicsStage) -> None: ...


@dataclass
class HookContext:
    """What a hook sees. Thermodynamic quantities are methods of ``dynamics``."""

    batch: Batch
    step: int
    dynamics: BaseDynamics

    @property
    def time_fs(self) -> float:
        return self.step * self.dynamics.dt_fs

    @property
    def outputs(self) -> dict[str, torch.Tensor]:
        """The last model outputs (energy, forces, maybe stress and per-atom energies)."""
        return self.dynamics.outputs


def hook_stages(hook: DynamicsHook) -> tuple[DynamicsStage, ...]:
    stage = hook.stage
    return (stage,) if isinstance(stage, DynamicsStage) else tuple(stage)


class BaseDynamics:
    """Common machinery; subclasses implement `pre_update` and `post_update`.

    ``model`` is a `ModelWrapper` (or anything called as ``model(batch,
    compute_stress=...)`` returning "energy" and "forces"). ``dt`` is in fs. ``reduce``
    is the coordinator for global sums (single-process by default). When the model
    declares a cutoff and no `NeighborListHook` is among ``hooks``, one with a
    ``skin`` Angstrom Verlet skin is put first; pass ``skin=None`` to add none (models
    with ``manages_neighbor_list = True`` get none either).
    """

    # fields the integrator reads on top of positions/masses; checked at `run`
    required_fields: tuple[str, ...] = ()
    # degrees of freedom removed per system (0: ASE's 3N convention)
    removed_dof_per_system: int = 0
    # whether `compute` asks the model for the stress (barostats set this)
    compute_stress: bool = False
    # also on configurations whose step is a multiple of this (0: never): the thermo log's
    # pressure; set the same on every rank (a hook of LOCAL scope), or the collectives differ
    stress_every: int = 0
    # whether the blow-up check bounds the per-step displacement (NOTE [blow-up check]);
    # an optimiser limits its own steps and may start from huge forces, so FIRE says no
    bounds_step_displacement: bool = True

    def __init__(
        self,
        model,
        dt: float,
        hooks: Iterable[DynamicsHook] = (),
        *,
        reduce: GlobalReducer | None = None,
        skin: float | None = DEFAULT_SKIN,
        nan_check_every: int = 1,
        max_step_displacement: float = MAX_STEP_DISPLACEMENT,
    ):
        dt = float(dt)
        if not (dt > 0 and math.isfinite(dt)):
            raise InputError(
                f"time step must be a positive number of fs, got {dt}; try 1.0 to 2.0 fs"
            )
        self.model = model
        self.dt_fs = dt
        self.dt = dt * units.fs
        self.reduce = reduce if reduce is not None else GlobalReducer()
        self.nan_check_every = int(nan_check_every)
        self.max_step_displacement = float(max_step_displacement)
        self.hooks: list[DynamicsHook] = []
        for hook in hooks:
            self.add_hook(hook)
        self._maybe_add_neighbor_hook(skin)
        self.step_count = 0
        self.target_step = 0
        self.batch: Batch | None = None
        self.outputs: dict[str, torch.Tensor] = {}

    # ---- restartable state ----------------------------------------------------------------
    # NOTE [declared state]: a checkpoint restores these attributes and nothing else
    # (never hooks, checks or settings such as dt and temperature: those are the script's);
    # integrators with more state (thermostat chains) override state_dict/load_state_dict.
    state_fields: tuple[str, ...] = ("step_count",)

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.state_fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the declared `state_fields` found in ``state``; other keys are ignored."""
        step = state.get("step_count", self.step_count)
        if isinstance(step, torch.Tensor):
            step = step.item()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InputError(
                f"the saved step_count {step!r} is not a non-negative integer; the checkpoint is "
                "damaged or was not written by mlipdd: use another one"
            )
        self.step_count = self.target_step = int(step)
        for name in self.state_fields:
            if name == "step_count" or name not in state:
                continue
            value = state[name]
            if value is not None and not isinstance(value, (torch.Tensor, int, float)):
                raise InputError(
                    f"the saved {name!r} is a {type(value).__name__}, not a number or tensor; "
                    "the checkpoint is damaged or was not written by mlipdd: use another one"
                )
            setattr(self, name, value)

    # ---- hooks --------------------------------------------------------------------------
    def add_hook(self, hook: DynamicsHook, first: bool = False) -> None:
        if not isinstance(hook, DynamicsHook):
            raise InputError(
                f"{hook!r} is not a dynamics hook: give it a `stage`, an integer `frequency` "
                "and `__call__(ctx, stage)`"
            )
        if int(hook.frequency) < 1:
            raise InputError(f"hook {type(hook).__name__} has frequency {hook.frequency}; use >= 1")
        if first:
            self.hooks.insert(0, hook)
        else:
            self.hooks.append(hook)

    def _maybe_add_neighbor_hook(self, skin: float | None) -> None:
        from mlipdd.dynamics.hooks.neighbor_list import NeighborListHook

        cutoff = getattr(self.model, "cutoff", None)
        # a model that builds its own lists (a distributed model builds one per
        # subdomain, with ghosts) says so with `manages_neighbor_list = True`
        if skin is None or cutoff is None or getattr(self.model, "manages_neighbor_list", False):
            return
        if any(isinstance(h, NeighborListHook) for h in self.hooks):
            return
        from mlipdd.neighbors import NeighborListPolicy

        self.add_hook(
            NeighborListHook(NeighborListPolicy(float(cutoff), skin=float(skin))), first=True
        )

    def fire(self, stage: DynamicsStage) -> None:
        ctx = None
        for hook in self.hooks:
            if stage not in hook_stages(hook):
                continue
            if stage not in ONCE_PER_RUN and self.step_count % int(hook.frequency) != 0:
                continue
            ctx = ctx or HookContext(self.batch, self.step_count, self)
            hook(ctx, stage)

    # ---- forces -------------------------------------------------------------------------
    def compute(self) -> dict[str, torch.Tensor]:
        """Run the model on ``self.batch``; store energy, forces (and stress) on it."""
        batch = self.batch
        self.fire(DynamicsStage.BEFORE_COMPUTE)
        # Forces come from autograd *inside* the wrapper (it enables grad itself); out
        # here no graph is wanted, so none is kept alive across steps.
        with torch.no_grad():
            out = self.model(batch, compute_stress=self._wants_stress())
        missing = {"energy", "forces"} - set(out)
        if missing:
            raise InputError(
                f"the model returned {sorted(out)} but dynamics needs {sorted(missing)} too; "
                "check the wrapper's forward"
            )
        # detached so no autograd node of this step outlives it
        out = {k: v.detach() if torch.is_tensor(v) else v for k, v in out.items()}
        batch.energy = out["energy"]
        batch.forces = out["forces"]
        if "stress" in out:
            batch.stress = out["stress"]
        self.outputs = out
        if self.nan_check_every and self.step_count % self.nan_check_every == 0:
            self._check_not_blown_up()
        self.fire(DynamicsStage.AFTER_COMPUTE)
        return out

    def _wants_stress(self) -> bool:
        if self.compute_stress:
            return True
        step = getattr(self, "_configuration_step", None)
        step = self.step_count if step is None else step
        return self.stress_every > 0 and step % self.stress_every == 0

    def _check_not_blown_up(self) -> None:
        """NOTE [blow-up check]: LAMMPS stops with "Lost atoms" once atoms have flown off;
        we stop one step earlier, before the AFTER_STEP hooks write the bad frame. Each
        check looks at the energy (replicated) and at how far any atom would move in one
        step, ``|v| dt + |F| dt^2 / 2m``: beyond ``max_step_displacement`` (1 A: a hundred
        times a normal MD step) or not finite, the run stops on every rank together (the
        largest reach is reduced over ranks, one all-reduce per check)."""
        batch = self.batch
        step = getattr(self, "_configuration_step", None) or self.step_count
        # energy is global (replicated under DD), so every rank raises together
        if not bool(torch.isfinite(batch.energy).all()):
            raise BlowUpError(
                f"energy became {batch.energy.tolist()} at step {step}: "
                + self._blow_up_advice()
            )
        if not self.bounds_step_displacement:
            return
        value = float(self.reduce.max(self._local_step_reach()).max())
        if not value <= self.max_step_displacement:  # NaN fails this test too
            vmax, fmax = (float(x) for x in self.reduce.max(self._local_speed_and_force()))
            raise BlowUpError(
                f"at step {step} an atom would move {value:.3g} A in one step (limit "
                f"max_step_displacement = {self.max_step_displacement:g} A; largest speed "
                f"{vmax * units.fs:.3g} A/fs, largest force {fmax:.3g} eV/A): "
                + self._blow_up_advice()
            )

    def _blow_up_advice(self) -> str:
        return (
            f"the system blew up (or is about to). The likely cause is the time step "
            f"({self.dt_fs:g} fs): lower the time step (0.5-1 fs with hydrogen, 2-5 fs for heavy "
            "atoms); otherwise check the model and relax the starting structure first "
            "(overlapping atoms give huge forces)"
        )

    def _local_step_reach(self) -> torch.Tensor:
        batch = self.batch
        out = torch.zeros(1, dtype=batch.dtype, device=batch.device)
        if batch.num_atoms == 0:
            return out
        accel = batch.forces.norm(dim=-1) / batch.atomic_masses
        reach = 0.5 * accel * self.dt**2
        if batch.velocities is not None:
            reach = reach + batch.velocities.norm(dim=-1) * self.dt
        # NaN must survive the max (torch.max propagates it; a NaN compare would hide it)
        return out + reach.max()

    def _local_speed_and_force(self) -> torch.Tensor:
        batch = self.batch
        out = torch.zeros(2, dtype=batch.dtype, device=batch.device)
        if batch.num_atoms == 0:
            return out
        speed = batch.velocities.norm(dim=-1).max() if batch.velocities is not None else out[0]
        return torch.stack([speed, batch.forces.norm(dim=-1).max()])

    # ---- integration --------------------------------------------------------------------
    def pre_update(self, batch: Batch) -> None:
        """Everything before the force call: usually half kick + drift."""
        raise NotImplementedError(f"{type(self).__name__} must implement pre_update")

    def post_update(self, batch: Batch) -> None:
        """Everything after the force call: usually the second half kick."""
        raise NotImplementedError(f"{type(self).__name__} must implement post_update")

    def converged(self) -> bool | torch.Tensor:
        """Optimisers say when to stop (a rank-local answer; `run` reduces it)."""
        return False

    def step(self) -> None:
        batch = self.batch
        self.fire(DynamicsStage.BEFORE_STEP)
        self.pre_update(batch)
        self.fire(DynamicsStage.AFTER_POSITIONS)
        self._configuration_step = self.step_count + 1  # the positions now are this step's
        try:
            self.compute()
        finally:
            self._configuration_step = None
        self.post_update(batch)
        self.step_count += 1
        self.fire(DynamicsStage.AFTER_STEP)

    def setup(self, batch: Batch) -> None:
        """Validate ``batch``, make it current, evaluate forces if they are not current."""
        self.check_batch(batch)
        fresh = batch is not self.batch or batch.forces is None or batch.energy is None
        self.batch = batch
        if fresh:
            self.compute()

    def run(self, batch: Batch, n_steps: int) -> Batch:
        """Advance ``batch`` by ``n_steps`` steps in place; returns it.

        Forces are evaluated first unless ``batch`` is the one the last `run` left
        (so consecutive runs continue exactly).
        """
        n_steps = int(n_steps)
        if n_steps < 0:
            raise InputError(f"n_steps must be >= 0, got {n_steps}")
        self.setup(batch)
        self.target_step = self.step_count + n_steps
        self.fire(DynamicsStage.BEFORE_RUN)
        checks_convergence = type(self).converged is not BaseDynamics.converged
        for _ in range(n_steps):
            self.step()
            if checks_convergence and self.reduce.any(bool(self.converged())):
                self.fire(DynamicsStage.ON_CONVERGE)
                break
            if _stop.watching() and self.reduce.any(_stop.stop_requested() is not None):
                # every rank stops after this same step (NOTE [clean stop]); AFTER_RUN
                # closes the trajectory and writes the last checkpoint first
                self.fire(DynamicsStage.AFTER_RUN)
                raise _stop.RunStopped(
                    self.step_count,
                    _stop.stop_requested() or "a stop was requested on another rank",
                    _stop.requested_signal(),
                )
        self.fire(DynamicsStage.AFTER_RUN)
        return batch

    def check_batch(self, batch: Batch) -> None:
        if not isinstance(batch, Batch):
            raise InputError(
                f"dynamics runs on an mlipdd Batch, got {type(batch).__name__}; "
                "build one with Batch.from_ase(atoms) or AtomicData(...)"
            )
        if batch.atomic_masses is None:
            raise InputError(
                "the batch has no atomic_masses; pass atomic_masses= to AtomicData "
                "or leave it out there to get standard masses"
            )
        if "velocities" in self.required_fields and batch.velocities is None:
            raise InputError(
                f"{type(self).__name__} needs velocities but the batch has none; attach them "
                'with data.add_node_property("velocities", v) (Angstrom per ASE time unit, as '
                "Atoms.get_velocities()) or draw them with "
                "mlipdd.dynamics.initialize_velocities(batch, temperature, seed)"
            )
        batch.validate(require=self.required_fields)
        if not self.reduce.is_distributed:  # a rank may own no atoms; a whole system may not
            check_not_empty(batch)
        supported = _supported_dtypes(self.model)
        if supported and batch.dtype not in supported:
            raise InputError(
                f"the model supports {list(supported)} but the batch is {batch.dtype}; convert "
                f"with batch.to(dtype={supported[0]})"
            )

    # ---- global quantities (every one goes through self.reduce) -------------------------
    def kinetic_energy(self) -> torch.Tensor:
        return _reduce.kinetic_energy(self.batch, self.reduce)

    def potential_energy(self) -> torch.Tensor:
        return self.batch.energy

    def temperature(self) -> torch.Tensor:
        return _reduce.temperature(self.batch, self.reduce, self.removed_dof_per_system)

    def conserved_energy(self) -> torch.Tensor:
        """The quantity this integrator conserves (NVE: total energy); per system, eV."""
        return self.potential_energy() + self.kinetic_energy()

    def num_atoms(self) -> int:
        return int(_reduce.atoms_per_system(self.batch, self.reduce).sum())


def _supported_dtypes(model) -> Sequence[Any]:
    config = getattr(model, "model_config", None)
    return tuple(getattr(config, "supported_dtypes", ()) or ())
