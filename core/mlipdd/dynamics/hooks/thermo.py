"""Thermodynamic log: step, time, potential / kinetic / total energy, temperature, volume;
as text lines and, optionally, as CSV (what `mlipdd plot` reads)."""

from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path
from typing import IO

from mlipdd.dynamics.base import DynamicsStage

_LOGGER = logging.getLogger("mlipdd.dynamics")

COLUMNS = ("step", "time_ps", "system", "epot", "ekin", "etot", "econs", "temperature", "volume")
_HEADER = (
    f"{'step':>8} {'time[ps]':>10} {'sys':>3} {'Epot[eV]':>15} {'Ekin[eV]':>13} "
    f"{'Etot[eV]':>15} {'Econs[eV]':>15} {'T[K]':>9}"
)


class ThermoLogger:
    """Log every ``frequency`` steps (and the starting state) to ``output``.

    ``output`` is a `logging.Logger` (default: "mlipdd.dynamics" at INFO), a path
    (appended to, flushed every line) or an open text stream. One line per system.
    ``Econs`` is the integrator's conserved quantity (NVE: Etot; Langevin: Etot + the
    heat given to the bath). Every record is also kept in ``records`` (dicts keyed by
    `COLUMNS`), which is how `run_simulation` computes its summary. ``csv_path`` also
    writes every record as a CSV row (header `COLUMNS`; volume in A^3). ``echo``, when
    given, prints the text lines (a progress bar's ``write`` keeps them from tearing it).

    Under domain decomposition every rank computes the (reduced) numbers, because the
    reductions are collective; only the root rank writes. When the model reports a
    ``load_imbalance`` (a `DistributedModel`: max/mean owned atoms per rank at the latest
    neighbour-list rebuild), it is one more column, ``imbalance`` in the records.
    """

    stage = (DynamicsStage.BEFORE_RUN, DynamicsStage.AFTER_STEP)

    def __init__(
        self, output: logging.Logger | str | Path | IO[str] | None = None, frequency: int = 10,
        csv_path: str | Path | None = None, echo=None,
    ):
        self.frequency = int(frequency)
        self.csv_path = Path(csv_path) if csv_path is not None else None
        self._csv_file: IO[str] | None = None
        self._csv = None
        self._echo = echo
        self.records: list[dict] = []
        self._output = output if output is not None else _LOGGER
        self._file: IO[str] | None = None
        self._header_written = False
        self._last_step: int | None = None

    def __call__(self, ctx, stage) -> None:
        if ctx.step == self._last_step:  # BEFORE_RUN of a continued run repeats a step
            return
        self._last_step = ctx.step
        dyn = ctx.dynamics
        epot = dyn.potential_energy().detach().double().cpu()
        ekin = dyn.kinetic_energy().detach().double().cpu()
        econs = dyn.conserved_energy().detach().double().cpu()
        temp = dyn.temperature().detach().double().cpu()
        imbalance = getattr(dyn.model, "load_imbalance", None)
        volume = ctx.batch.cell.detach().double().cpu().det().abs()
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
                "volume": float(volume[s]),
            }
            line = (
                f"{rec['step']:8d} {rec['time_ps']:10.4f} {s:3d} {rec['epot']:15.6f} "
                f"{rec['ekin']:13.6f} {rec['etot']:15.6f} {rec['econs']:15.6f} {rec['temperature']:9.2f}"
            )
            if imbalance is not None:
                rec["imbalance"] = float(imbalance)
                line += f" {imbalance:14.3f}"
            self.records.append(rec)
            lines.append(line)
        if dyn.reduce.is_root:
            self._write(lines, with_imbalance=imbalance is not None)
            if self.csv_path is not None:
                self._write_csv(self.records[-len(lines):])

    def _write_csv(self, records: list[dict]) -> None:
        if self._csv is None:
            self.csv_path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.csv_path.exists() or self.csv_path.stat().st_size == 0
            self._csv_file = open(self.csv_path, "a", encoding="utf-8", newline="")  # noqa: SIM115
            extra = [k for k in records[0] if k not in COLUMNS]  # e.g. imbalance under DD
            self._csv = csv.DictWriter(self._csv_file, fieldnames=[*COLUMNS, *extra])
            if fresh:  # a restarted run appends to its own file
                self._csv.writeheader()
        self._csv.writerows(records)
        self._csv_file.flush()

    def _write(self, lines: list[str], with_imbalance: bool = False) -> None:
        if not self._header_written:
            lines = [_HEADER + (f" {'owned max/mean':>14}" if with_imbalance else ""), *lines]
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
        stream.write("\n".join(lines) + "\n")
        stream.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file, self._csv = None, None
