"""One run from a plain configuration: what ``mlipdd run`` executes on one process.

`run_simulation` is split into `build_model`, `prepare_system`, `build_dynamics` and the
timed loop so the launcher for several ranks (`mlipdd.app.launch`) reuses the pieces
(wrap the dynamics, partition the batch) without re-parsing anything. This package is
the top layer: it uses the library (models, dynamics, distributed), nothing uses it.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlipdd.app.defaults import default_temperature, default_timestep, timestep_warning
from mlipdd.app.ensembles import ENSEMBLES, OPTIMISERS, build_dynamics
from mlipdd.app.setting_checks import check_device, check_setting_types
from mlipdd.app.structure import read_structure as _read_structure
from mlipdd.app.summary_text import format_summary
from mlipdd.data import Batch, InputError
from mlipdd.dynamics.hooks import ProgressBar, ThermoLogger, TrajectoryWriter
from mlipdd.dynamics.velocities import initialize_velocities

# Argon (Rowley, Nicholson & Parsonage): the model of the default run.
ARGON_LJ = {"epsilon": 0.0104, "sigma": 3.4, "cutoff": 8.5}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def strategy_names() -> list[str]:
    """Every registered strategy: the built-in halo, sharded, graph_partition and plugins'."""
    from mlipdd.plugins import registry

    return sorted(registry().strategies)


__all__ = ["ENSEMBLES", "RunConfig", "build_dynamics", "format_summary", "run_simulation"]


@dataclass
class RunConfig:
    """Every setting of a run; the defaults are the built-in demo (LJ argon, NVT, 94 K)."""

    # None: unset; a restart takes it from the checkpoint, else `UNSET_DEFAULTS` fills it
    model: str | None = None  # default lj
    model_args: dict[str, Any] = field(default_factory=dict)
    system: str | None = None  # a built-in (mlipdd.lattices.SYSTEMS) or a file; fcc_argon
    size: int | None = None  # cells per axis (built-ins) or repeats of the file's cell
    frame: int | None = None  # which frame of a --system file (None: the first, said if several)
    ensemble: str | None = None  # default nvt
    steps: int = 100
    dt: float | None = None  # fs; None: from the system (5 noble gases, 0.5 with H, else 1)
    temperature: float | None = None  # K; None: from the system (94 noble gases, else 300)
    friction: float | None = None  # 1/fs; default 0.01
    pressure: float | None = None  # bar (npt, nph); default 1
    tdamp: float | None = None  # fs, thermostat time constant (nh, npt); None: 100 dt
    pdamp: float | None = None  # fs, barostat time constant (npt, nph); None: 1000 dt
    fmax: float = 0.05  # eV/A, convergence of fire / fire2
    restart: str | None = None  # continue from this checkpoint (any number of ranks)
    restart_allow_model_change: bool = False  # a restart may use another model (mlipdd.app.restart)
    seed: int | None = None  # default 0
    trajectory: str | None = None
    trajectory_every: int = 10
    log_every: int = 10  # 0: no thermo lines
    log_file: str | None = None  # thermo lines go here instead of stdout
    thermo_csv: str | None = None  # the thermo records also as CSV (mlipdd plot reads it)
    thermo: str | None = None  # thermo log columns (LAMMPS thermo_style custom names); None: default
    dtype: str = "float64"
    device: str = "auto"  # "auto": cuda when available
    skin: float = 0.5  # Angstrom, neighbour-list skin
    progress: str = "auto"  # "auto"/"on": a bar on a terminal, plain lines otherwise
    # domain decomposition (run by mlipdd.app.launch; 1 rank: plain single process)
    nproc: int = 1  # local ranks `mlipdd run` starts itself (torchrun / srun: ranks join)
    strategy: str = "auto"  # "auto": the model's preferred strategy on several ranks (MACE: sharded)
    grid: list[int] | None = None  # rank grid (gx, gy, gz); None: the least halo
    # seconds a rank waits in a collective for the others before the run fails
    # (mlipdd.distributed.manager.DEFAULT_COLLECTIVE_TIMEOUT_S says why this value)
    collective_timeout: float = 300.0
    checkpoint: str | None = None  # write the full state here (also when stopped by a signal)
    checkpoint_every: int = 1000
    balance: str | None = None  # None: uniform cut planes; "count" / "time": see DomainConfig
    # the force call (mlipdd.distributed.DomainConfig): replayed from a CUDA graph (one rank),
    # or compiled with this torch.compile backend ("inductor", "aot_eager"; at several ranks:
    # models with per-atom energies, LJ and MACE, under halo storage); None: eager
    cuda_graph: bool = False
    compile: str | None = None

    def with_defaults(self) -> RunConfig:
        """Unset settings (None) that do not depend on the system filled with `UNSET_DEFAULTS`."""
        return dataclasses.replace(
            self, **{k: v for k, v in UNSET_DEFAULTS.items() if getattr(self, k) is None}
        )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {str(k).replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InputError(f"unknown run setting(s) {unknown}; known settings: {sorted(known)}")
        return cls(**check_setting_types(cls, values)).checked()

    def checked(self) -> RunConfig:
        if self.ensemble is not None and self.ensemble not in ENSEMBLES:
            raise InputError(f"ensemble {self.ensemble!r} is not one of {tuple(ENSEMBLES)}")
        if self.strategy not in ("auto", *strategy_names()):
            raise InputError(f"strategy {self.strategy!r} is not one of {['auto', *strategy_names()]}")
        for name in ("dt", "temperature", "tdamp", "pdamp", "fmax", "friction"):
            value = getattr(self, name)
            if value is not None and not float(value) > 0:
                raise InputError(f"{name} must be positive, got {value}")
        if self.restart is not None and not Path(self.restart).is_file():
            raise InputError(f"restart file {self.restart!r} does not exist; give a checkpoint "
                             "written by --checkpoint")
        if self.dtype not in DTYPES:
            raise InputError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if int(self.steps) < 0:
            raise InputError(f"steps must be >= 0, got {self.steps}")
        if not isinstance(self.model_args, Mapping):
            raise InputError(
                f"model_args must be a mapping of keyword arguments, got {self.model_args!r}"
            )
        if int(self.nproc) < 1:
            raise InputError(f"nproc must be >= 1, got {self.nproc}")
        if self.grid is not None and (len(self.grid) != 3 or min(int(g) for g in self.grid) < 1):
            raise InputError(f"grid must be three positive integers, got {self.grid}")
        if not float(self.collective_timeout) > 0:
            raise InputError(
                f"collective_timeout must be a positive number of seconds, got {self.collective_timeout}"
            )
        if int(self.checkpoint_every) < 1:
            raise InputError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.balance not in (None, "count", "time"):
            raise InputError(f"balance must be count or time (or left out), got {self.balance!r}")
        if self.progress not in ("auto", "on", "off"):
            raise InputError(f"progress must be auto, on or off, got {self.progress!r}")
        check_device(self.device)
        self._check_force_call()
        return self

    def _check_force_call(self) -> None:
        if self.cuda_graph and self.compile:
            raise InputError("--cuda-graph and --compile: choose one (a CUDA graph replays the eager "
                             "force call; compile fuses its kernels)")
        if self.cuda_graph and int(self.nproc) > 1:
            raise InputError(f"--cuda-graph runs at one rank; this run asks for --nproc {self.nproc}: "
                             "drop --cuda-graph with several ranks (their force call runs eagerly)")
        if self.compile is not None and not self.compile:
            raise InputError("compile must name a torch.compile backend (inductor, aot_eager) or be left out")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


# what an unset setting becomes when no checkpoint gives it (dt and temperature: the system's)
UNSET_DEFAULTS = {
    "model": "lj", "system": "fcc_argon", "ensemble": "nvt", "seed": 0, "friction": 0.01,
    "pressure": 1.0,
}


def build_model(cfg: RunConfig):
    from mlipdd.plugins import create_model, registry

    name = cfg.model or UNSET_DEFAULTS["model"]
    args = dict(cfg.model_args)
    if name == "lj":
        args = {**ARGON_LJ, **args}
    # a factory that takes device/dtype builds there (mace converts to cuEquivariance on the
    # GPU it will run on; aimnet2 keeps its float64 shifts); the rest are moved after
    device, dtype = cfg.resolved_device(), DTYPES[cfg.dtype]
    takes = inspect.signature(registry().models[name].factory).parameters if name in registry().models else {}
    for key, value in (("device", str(device)), ("dtype", dtype)):
        if key in takes and key not in args:
            args[key] = value
    model = create_model(name, **args)
    return model.to(device=device, dtype=dtype)


def build_structure(cfg: RunConfig) -> Batch:
    """The starting structure (no velocities yet) from a built-in name or a file."""
    from mlipdd.lattices import SYSTEMS
    from mlipdd.lattices import build_system as build_builtin

    dtype, device = DTYPES[cfg.dtype], cfg.resolved_device()
    system = cfg.system or UNSET_DEFAULTS["system"]
    if system in SYSTEMS:
        return build_builtin(system, size=cfg.size, temperature=None, dtype=dtype, device=device)
    return _read_structure(Path(system), cfg.size, dtype, device, cfg.frame)


def prepare_system(cfg: RunConfig) -> tuple[RunConfig, Batch, Any]:
    """The starting batch, the settings with every default filled in, and the checkpoint
    when restarting (else None). Velocities are drawn at the temperature unless the
    structure (or checkpoint) has some; optimisers start at rest.

    Unset settings come from the restart's checkpoint (its model, system, ensemble, dt,
    temperature, seed, ...; a model or system other than its own is refused, see
    `mlipdd.app.restart`), then from `UNSET_DEFAULTS` and the system. So build the model
    from the settings this returns."""
    from mlipdd.app.restart import (
        check_trajectory_continues,
        read_restart,
        settings_from_checkpoint,
    )

    checkpoint = read_restart(cfg)
    if checkpoint is not None:
        cfg = settings_from_checkpoint(cfg, checkpoint)
    cfg = cfg.with_defaults()
    if checkpoint is not None:
        check_trajectory_continues(cfg, checkpoint.step)
        batch = checkpoint.batch.to(dtype=DTYPES[cfg.dtype])
    else:
        batch = build_structure(cfg)
    cfg = with_system_defaults(cfg, batch)
    if batch.velocities is None:
        initialize_velocities(batch, 0.0 if cfg.ensemble in OPTIMISERS else cfg.temperature, cfg.seed)
    return cfg, batch, checkpoint


def build_system(cfg: RunConfig) -> Batch:
    """The starting batch with velocities (`prepare_system` without the settings)."""
    return prepare_system(cfg)[1]


def with_system_defaults(cfg: RunConfig, batch: Batch) -> RunConfig:
    """``dt`` / ``temperature`` left unset take the system's defaults; a given time step
    that is long for these atoms (argon's 5 fs on hydrogen) is warned about on stderr."""
    species = torch.unique(batch.atomic_numbers).tolist()
    if cfg.dt is not None:
        warning = timestep_warning(float(cfg.dt), species)
        if warning:
            print(f"mlipdd run: {warning}", file=sys.stderr, flush=True)
    return dataclasses.replace(
        cfg,
        dt=float(cfg.dt) if cfg.dt is not None else default_timestep(species),
        temperature=float(cfg.temperature) if cfg.temperature is not None
        else default_temperature(species),
    )


def default_hooks(cfg: RunConfig, thermo_stream=None) -> list:
    """Thermo log (always: the summary reads its records), trajectory, progress bar."""
    quiet = cfg.log_every <= 0
    if quiet:
        output = io.StringIO()
    else:
        output = cfg.log_file or (thermo_stream if thermo_stream is not None else sys.stdout)
    # when quiet, still sample ~50 states so the summary's mean temperature means something
    frequency = cfg.log_every if not quiet else max(1, int(cfg.steps) // 50)
    # on by default: a tqdm bar when stderr is a terminal, plain lines every 10 s otherwise
    progress = ProgressBar() if cfg.progress in ("on", "auto") else None
    echo = progress.write if progress is not None else None
    hooks: list = [ThermoLogger(output, frequency=frequency, csv_path=cfg.thermo_csv, echo=echo,
                                columns=cfg.thermo)]
    if cfg.trajectory:
        # a restart continues the file (NOTE [trajectory of a restart] in mlipdd.app.restart)
        hooks.append(TrajectoryWriter(cfg.trajectory, frequency=cfg.trajectory_every,
                                      append=bool(cfg.restart)))
    if cfg.checkpoint:
        # app-level wiring: the writer also serves a plain integrator (one process)
        from mlipdd.app.restart import run_record
        from mlipdd.distributed.checkpoint import CheckpointWriter

        hooks.append(CheckpointWriter(cfg.checkpoint, frequency=cfg.checkpoint_every,
                                      run=run_record(cfg)))
    if progress is not None:
        hooks.append(progress)
    return hooks


def run_simulation(
    config: RunConfig | Mapping[str, Any] | None = None, thermo_stream=None
) -> dict[str, Any]:
    """Build everything from ``config``, run it, and return a summary dict (see `format_summary`)."""
    cfg = config if isinstance(config, RunConfig) else RunConfig.from_mapping(config or {})
    cfg.checked()
    if cfg.checkpoint:  # before anything: a second run on the same path stops at once
        from mlipdd.distributed.checkpoint import hold_checkpoint_path, release_checkpoint_path

        hold_checkpoint_path(cfg.checkpoint)
        try:
            return _run(cfg, thermo_stream)
        finally:
            release_checkpoint_path(cfg.checkpoint)
    return _run(cfg, thermo_stream)


def _run(cfg: RunConfig, thermo_stream) -> dict[str, Any]:
    # the settings first: the model of a restart is the checkpoint's
    cfg, batch, checkpoint = prepare_system(cfg)
    model = build_model(cfg)
    if cfg.cuda_graph or cfg.compile:
        return _run_one_rank(cfg, model, batch, thermo_stream)
    hooks = default_hooks(cfg, thermo_stream)
    dyn = build_dynamics(cfg, model, hooks)
    if checkpoint is not None:
        from mlipdd.app.restart import settings_differences_as_notes
        from mlipdd.distributed.checkpoint import restore_dynamics

        with settings_differences_as_notes():
            restore_dynamics(dyn, checkpoint, device=batch.device)

    dyn.setup(batch)  # first force evaluation (and neighbour list) outside the timing
    first_step = dyn.step_count
    start_energy = dyn.conserved_energy().sum().item()
    _sync(batch.device)
    start = time.perf_counter()
    dyn.run(batch, cfg.steps)
    _sync(batch.device)
    wall = time.perf_counter() - start
    end_energy = dyn.conserved_energy().sum().item()
    for hook in hooks:
        if isinstance(hook, ThermoLogger):
            hook.close()
    return _summary(cfg, dyn, batch, hooks[0].records, wall, start_energy, end_energy, first_step)


def domain_config(cfg: RunConfig, model):
    """The `DomainConfig` of a run: its strategy, grid, balance and force-call settings."""
    from mlipdd.distributed.config import DomainConfig

    return DomainConfig(
        cutoff=model.cutoff,
        skin=cfg.skin,
        strategy=None if cfg.strategy == "auto" else cfg.strategy,
        grid=tuple(cfg.grid) if cfg.grid else None,
        balance=cfg.balance,
        cuda_graph=bool(cfg.cuda_graph),
        compile=cfg.compile is not None,
        **({"compile_backend": cfg.compile} if cfg.compile else {}),
    )


def _run_one_rank(cfg: RunConfig, model, batch: Batch, thermo_stream, adjust=None) -> dict[str, Any]:
    """A graphed or compiled force call: `DomainParallel` at one rank (no process group),
    which owns the neighbour list and hands the model plain tensors (NOTE [one rank]).
    ``adjust(distributed_model)`` before the first call (the CPU tests swap the CUDA
    capture for `mlipdd.testing.graph_replay.with_eager_replay`)."""
    from mlipdd.app.restart import restored_or_partitioned
    from mlipdd.distributed.domain_parallel import DomainParallel

    hooks = default_hooks(cfg, thermo_stream)
    dyn = build_dynamics(cfg, model)
    with DomainParallel(dyn, domain_config(cfg, model), cfg.steps, hooks) as dp:
        if adjust is not None:
            adjust(dp.model)
        owned = restored_or_partitioned(dp, cfg, batch)
        dyn.setup(owned)  # first force evaluation (and the compile or capture) outside the timing
        first_step, wall, start_energy, end_energy = timed_run(dp, dyn, owned)
        summary = _summary(cfg, dyn, owned, hooks[0].records, wall, start_energy, end_energy, first_step)
        summary["neighbor_list_builds"] = dp.strategy.rebuilds
        summary.update(force_call_summary(dp.model))
    return summary


def force_call_summary(distributed) -> dict[str, Any]:
    """Which force call ran (eager, CUDA graph, compiled) and its counters, for the summary."""
    stats = distributed.compile_stats
    if stats is not None:
        return {"force_call": f"compiled ({stats['backend']})", "compile": stats}
    if distributed.config.cuda_graph:
        return {"force_call": "cuda graph", "cuda_graph_captures": distributed.cuda_graph_captures}
    return {"force_call": "eager"}


def stopped_message(cfg: RunConfig, stopped) -> str:
    """What a run stopped by a signal (`RunStopped`) tells the user."""
    written = [f"trajectory {cfg.trajectory}"] if cfg.trajectory else []
    if cfg.checkpoint:
        written.append(f"checkpoint {cfg.checkpoint} (step {stopped.step})")
    files = "; wrote " + " and ".join(written) if written else ""
    return f"mlipdd run: {stopped}{files}"


def timed_run(dp, dyn, owned) -> tuple[int, float, float, float]:
    """``dp.run()`` after ``dyn.setup``: the first step, the wall time (the device
    synchronised at both ends) and the conserved energy before and after."""
    first_step = dyn.step_count
    start_energy = dyn.conserved_energy().sum().item()
    _sync(owned.device)
    start = time.perf_counter()
    dp.run()
    _sync(owned.device)
    wall = time.perf_counter() - start
    return first_step, wall, start_energy, dyn.conserved_energy().sum().item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _summary(cfg, dyn, batch, records, wall, start_energy, end_energy, first_step=0) -> dict[str, Any]:
    n_atoms, steps = dyn.num_atoms(), int(dyn.step_count - first_step)
    temps = [r["temperature"] for r in records if r["step"] > 0] or [
        r["temperature"] for r in records
    ]
    drift = (end_energy - start_energy) / n_atoms * 1000.0
    sim_ps = steps * cfg.dt / 1000.0
    nl = [h for h in dyn.hooks if hasattr(h, "num_builds")]
    return {
        "model": cfg.model,
        "system": cfg.system,
        "ensemble": cfg.ensemble,
        "n_atoms": n_atoms,
        "steps": steps,
        "dt_fs": cfg.dt,
        "dtype": cfg.dtype,
        "device": str(batch.device),
        "wall_s": wall,
        "steps_per_s": steps / wall if wall > 0 else float("nan"),
        "atom_steps_per_s": steps * n_atoms / wall if wall > 0 else float("nan"),
        "ns_per_day": sim_ps * 1e-3 / wall * 86400.0 if wall > 0 else float("nan"),
        "temperature_final_K": float(dyn.temperature().sum()),
        "temperature_mean_K": sum(temps) / len(temps),
        "conserved_energy_start_eV": start_energy,
        "energy_drift_meV_per_atom": drift,
        "energy_drift_meV_per_atom_per_ps": drift / sim_ps if sim_ps > 0 else float("nan"),
        "neighbor_list_builds": sum(h.num_builds for h in nl),
        "trajectory": cfg.trajectory,
        "temperature_K": cfg.temperature,
        "final_step": int(dyn.step_count),
        **({"converged": bool(dyn.converged()), "fmax_eV_per_A": cfg.fmax,
            "fmax_final_eV_per_A": float(dyn.max_force.max()),
            "energy_final_eV": float(dyn.potential_energy().sum()),
            "energy_change_eV": float(dyn.potential_energy().sum()) - start_energy}
           if cfg.ensemble in OPTIMISERS else {}),
    }
