"""Thermodynamic log: LAMMPS-like columns (step, time, pe, ke, etotal, econs, temp, press,
vol, fmax; `mlipdd.dynamics.hooks.thermo_columns`) as text lines and, optionally, as CSV
(what `mlipdd plot` reads)."""

from __future__ import annotations

import csv
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import torch
from ase import units

from mlipdd.data import InputError
from mlipdd.dynamics.base import DynamicsStage
from mlipdd.dynamics.hooks.thermo_columns import COLUMNS as THERMO_COLUMNS
from mlipdd.dynamics.hooks.thermo_columns import CSV_NAMES, default_columns, parse_columns

_LOGGER = logging.getLogger("mlipdd.dynamics")

# record keys, in CSV order (the CSV header names them by their thermo keyword)
COLUMNS = ("step", "time_ps", "system", "epot", "ekin", "etot", "econs", "temperature",
           "pressure", "volume", "fmax")
_GPA_PER_BAR = 1e-4


class ThermoLogger:
    """Log every ``frequency`` steps (and the starting state) to ``output``.

    ``output`` is a `logging.Logger` (default: "mlipdd.dynamics" at INFO), a path
    (appended to, flushed every line) or an open text stream. One line per system, with
    ``columns`` (LAMMPS ``thermo_style custom`` keywords, a string or a sequence; default:
    step time sys pe ke etotal econs temp press, plus vol under a barostat; an optimiser's:
    step sys pe fmax press). ``econs`` is the integrator's conserved quantity (NVE: etotal;
    Langevin: etotal + the heat given to the bath); ``press`` is in bar (LAMMPS metal units).
    Every record is also kept in ``records`` (dicts keyed by `COLUMNS`: epot, ekin, etot,
    econs, temperature, pressure, volume, fmax), which is how `run_simulation` computes its
    summary. ``csv_path`` also writes every record as a CSV row, every quantity whatever
    ``columns`` says, headed by the keywords (time as ``time_ps``, the system as ``system``).
    ``echo``, when given, prints the text lines (a progress bar's ``write`` keeps them from
    tearing it).

    The pressure needs the model's stress: a logger that sees the integrator itself (one
    process, or LOCAL scope under domain decomposition, where every rank runs it alike)
    asks for it on the steps it logs (``stress_every``); seen through a gathered view it
    logs a pressure only when the integrator computes the stress anyway (a barostat).
    A model that does not declare a stress output, or a system not periodic on all three
    axes, logs ``nan``; asking for ``press`` in ``columns`` then is an error naming why.

    Under domain decomposition every rank computes the (reduced) numbers, because the
    reductions are collective; only the root rank writes. When the model reports a
    ``load_imbalance`` (a `DistributedModel`: max/mean owned atoms per rank at the latest
    neighbour-list rebuild), it is one more column, ``imbalance`` in the records.
    """

    stage = (DynamicsStage.BEFORE_RUN, DynamicsStage.AFTER_STEP)

    def __init__(
        self, output: logging.Logger | str | Path | IO[str] | None = None, frequency: int = 10,
        csv_path: str | Path | None = None, echo=None, columns: str | Sequence[str] | None = None,
    ):
        self.frequency = int(frequency)
        self.columns = parse_columns(columns if columns is None or isinstance(columns, str)
                                     else " ".join(columns))
        self.csv_path = Path(csv_path) if csv_path is not None else None
        self._csv_file: IO[str] | None = None
        self._csv = None
        self._echo = echo
        self.records: list[dict] = []
        self._output = output if output is not None else _LOGGER
        self._file: IO[str] | None = None
        self._header_written = False
        self._last_step: int | None = None
        self._shown: tuple[str, ...] | None = None
        self._write_failed = False

    def __call__(self, ctx, stage) -> None:
        if ctx.step == self._last_step:  # BEFORE_RUN of a continued run repeats a step
            return
        self._last_step = ctx.step
        dyn = ctx.dynamics
        if self._shown is None:
            self._shown = self._choose_columns(ctx)
        epot = dyn.potential_energy().detach().double().cpu()
        ekin_t = dyn.kinetic_energy().detach()
        ekin = ekin_t.double().cpu()
        econs = dyn.conserved_energy().detach().double().cpu()
        temp = dyn.temperature().detach().double().cpu()
        imbalance = getattr(dyn.model, "load_imbalance", None)
        volume = ctx.batch.cell.detach().double().cpu().det().abs()
        pressure = _pressure_bar(dyn, ekin_t, ctx.batch)
        fmax = _max_force(dyn, ctx.batch)
        lines = []
        for s in range(epot.shape[0]):
            rec = {
                "step": ctx.step,
                "time_ps": ctx.time_fs / 1000.0,
                "system": s,
                "epot": float(epot[s]),
                "ekin": float(ekin[s]),
                "etot": float(epot[s] + ekin[s]),
                "econs": float(econs[s]),
                "temperature": float(temp[s]),
                "pressure": float(pressure[s]),
                "volume": float(volume[s]),
                "fmax": float(fmax[s]),
            }
            if imbalance is not None:
                rec["imbalance"] = float(imbalance)
            self.records.append(rec)
            lines.append(self._line(rec))
        if dyn.reduce.is_root:
            self._write(lines)
            if self.csv_path is not None:
                self._write_csv(self.records[-len(lines):])

    # ---- columns --------------------------------------------------------------------------
    def _choose_columns(self, ctx) -> tuple[str, ...]:
        dyn = ctx.dynamics
        # a pressure is a bulk quantity: a molecule, cluster or slab in a box of vacuum has none
        # worth printing (LAMMPS would divide by the vacuum's volume); NPT needs the same
        pressure_possible = _declares_stress(dyn.model) and bool(ctx.batch.pbc.all())
        wanted = self.columns or default_columns(
            optimiser=hasattr(dyn, "max_force"), barostat=bool(dyn.__class__.compute_stress))  # the class: a view reports its integrator's
        if "press" in wanted or "press_gpa" in wanted:
            if not pressure_possible:
                if self.columns is not None:
                    raise InputError(
                        "the thermo column press needs the model's stress and a cell with a volume: "
                        f"{_no_pressure_reason(dyn.model, ctx.batch)}; leave press out of the columns")
                wanted = tuple(k for k in wanted if k not in ("press", "press_gpa"))
            elif getattr(dyn, "wrapped_dynamics", None) is None:  # the integrator itself (LOCAL)
                self._ask_for_stress(dyn)
        if getattr(dyn.model, "load_imbalance", None) is not None and "imbalance" not in wanted \
                and self.columns is None:
            wanted = (*wanted, "imbalance")
        return wanted

    def _ask_for_stress(self, dyn) -> None:
        if dyn.compute_stress:
            return
        dyn.stress_every = self.frequency
        if "stress" not in dyn.outputs:  # the configuration logged now was computed without
            dyn.compute()  # every rank alike (LOCAL scope): identical forces, plus the stress

    def _line(self, rec: dict) -> str:
        parts = []
        for keyword in self._shown:
            column = THERMO_COLUMNS[keyword]
            value = rec.get(column.record)
            if keyword == "press_gpa":
                value = rec["pressure"] * _GPA_PER_BAR
            parts.append(f"{value:{column.width}{column.fmt}}" if value is not None
                         else f"{'-':>{column.width}}")
        return " ".join(parts)

    def _header(self) -> str:
        return " ".join(f"{THERMO_COLUMNS[k].header:>{THERMO_COLUMNS[k].width}}" for k in self._shown)

    def _write_csv(self, records: list[dict]) -> None:
        if self._csv is None:
            self.csv_path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.csv_path.exists() or self.csv_path.stat().st_size == 0
            self._csv_file = open(self.csv_path, "a", encoding="utf-8", newline="")  # noqa: SIM115
            keys = [*COLUMNS, *(k for k in records[0] if k not in COLUMNS)]  # e.g. imbalance under DD
            self._csv = csv.writer(self._csv_file)
            self._csv_keys = keys
            if fresh:  # a restarted run appends to its own file
                self._csv.writerow([CSV_NAMES.get(k, k) for k in keys])
        try:
            self._csv.writerows([[r.get(k) for k in self._csv_keys] for r in records])
            self._csv_file.flush()
        except OSError:
            self._write_failed = True  # close() must not raise the same error again
            raise

    def _write(self, lines: list[str]) -> None:
        if not self._header_written:
            lines = [self._header(), *lines]
            self._header_written = True
        out = self._output
        if isinstance(out, logging.Logger):
            for line in lines:
                out.info(line)
            return
        if isinstance(out, (str, Path)):
            if self._file is None:
                self._file = open(out, "a", encoding="utf-8")  # noqa: SIM115 - kept open across steps
            stream = self._file
        else:
            stream = out
        if self._echo is not None and stream in (sys.stdout, sys.stderr):
            self._echo("\n".join(lines) + "\n", stream)
            return
        try:
            stream.write("\n".join(lines) + "\n")
            stream.flush()
        except OSError:
            self._write_failed = True
            raise

    def close(self) -> None:
        for name in ("_file", "_csv_file"):
            handle = getattr(self, name)
            setattr(self, name, None)
            if handle is None:
                continue
            try:
                handle.close()
            except OSError:
                if not self._write_failed:
                    raise  # a failure already reported once is not raised a second time
        self._csv = None


def _declares_stress(model) -> bool:
    """The model (or the one a DistributedModel wraps) lists a stress output."""
    for candidate in (model, getattr(model, "model", None)):
        config = getattr(candidate, "model_config", None)
        if config is not None:
            return "stress" in getattr(config, "outputs", ())
    return False


def _no_pressure_reason(model, batch) -> str:
    if not _declares_stress(model):
        return f"{type(model).__name__} declares no stress output"
    return "a system is not periodic on all three axes (a molecule, cluster or slab)"


def _pressure_bar(dyn, ekin: torch.Tensor, batch) -> torch.Tensor:
    """Per system, bar: 2 Ekin / 3V - tr(stress) / 3; nan without a current stress."""
    stress = dyn.outputs.get("stress") if isinstance(getattr(dyn, "outputs", None), dict) else None
    n = ekin.shape[0]
    if stress is None:
        return torch.full((n,), float("nan"), dtype=torch.float64)
    volume = batch.cell.detach().det().abs().to(ekin.dtype)
    kinetic = 2.0 * ekin / (3.0 * volume)
    virial = -stress.detach().diagonal(dim1=-2, dim2=-1).sum(-1).to(ekin.dtype) / 3.0
    return ((kinetic + virial) / units.bar).double().cpu()


def _max_force(dyn, batch) -> torch.Tensor:
    """Largest |F_i| per system (an optimiser's own measure when it has one)."""
    measured = getattr(dyn, "max_force", None)
    if measured is None:
        norms = batch.forces.detach().norm(dim=-1)
        local = torch.zeros(batch.num_systems, dtype=norms.dtype, device=norms.device)
        local = local.scatter_reduce(0, batch.batch, norms, reduce="amax", include_self=True)
        measured = dyn.reduce.max(local)
    return measured.detach().double().cpu()
