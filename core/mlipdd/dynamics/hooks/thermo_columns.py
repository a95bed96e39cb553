"""The thermo log's columns: LAMMPS ``thermo_style custom`` keywords, metal units.

Each keyword names one quantity per system, its unit, the record key `ThermoLogger`
stores it under (the records keep their original names: ``epot``, ``temperature``, ...)
and a text format. ``press`` is in bar as in LAMMPS' metal units (``press_gpa`` in GPa):
the kinetic part ``2 Ekin / 3V`` plus the virial ``-tr(stress) / 3``, from the model's
stress, which the logger asks for on the steps it logs (a barostat has it on every step).
"""

from __future__ import annotations

from typing import NamedTuple

from mlipdd.data import InputError


class Column(NamedTuple):
    keyword: str  # what --thermo and the CSV header call it
    record: str  # key in ThermoLogger.records
    header: str  # text-log header, with the unit
    width: int
    fmt: str  # format of the value (after the width)


COLUMNS = {c.keyword: c for c in (
    Column("step", "step", "step", 8, "d"),
    Column("time", "time_ps", "time[ps]", 10, ".4f"),
    Column("sys", "system", "sys", 3, "d"),
    Column("pe", "epot", "pe[eV]", 15, ".6f"),
    Column("ke", "ekin", "ke[eV]", 13, ".6f"),
    Column("etotal", "etot", "etotal[eV]", 15, ".6f"),
    Column("econs", "econs", "econs[eV]", 15, ".6f"),
    Column("temp", "temperature", "temp[K]", 9, ".2f"),
    Column("press", "pressure", "press[bar]", 12, ".2f"),
    Column("press_gpa", "pressure_gpa", "press[GPa]", 11, ".5f"),
    Column("vol", "volume", "vol[A^3]", 12, ".3f"),
    Column("fmax", "fmax", "fmax[eV/A]", 11, ".5f"),
    Column("imbalance", "imbalance", "owned max/mean", 14, ".3f"),
)}
# the CSV's header names for the record keys (time keeps its unit: mlipdd plot reads time_ps)
CSV_NAMES = {"time_ps": "time_ps", "system": "system", **{
    c.record: c.keyword for c in COLUMNS.values() if c.record not in ("time_ps", "system")}}

MD_DEFAULT = ("step", "time", "sys", "pe", "ke", "etotal", "econs", "temp", "press")
BAROSTAT_DEFAULT = (*MD_DEFAULT, "vol")
OPTIMISER_DEFAULT = ("step", "sys", "pe", "fmax", "press")


def parse_columns(text: str | None) -> tuple[str, ...] | None:
    """``"step temp pe press"`` (spaces or commas) -> keywords; None: the default set."""
    if text is None:
        return None
    keywords = tuple(k for k in text.replace(",", " ").split() if k)
    unknown = [k for k in keywords if k not in COLUMNS]
    if unknown or not keywords:
        raise InputError(
            f"thermo column(s) {unknown or repr(text)} unknown; choose from {' '.join(COLUMNS)} "
            "(LAMMPS thermo_style custom names, metal units: press in bar)"
        )
    return keywords


def default_columns(optimiser: bool, barostat: bool) -> tuple[str, ...]:
    if optimiser:
        return OPTIMISER_DEFAULT
    return BAROSTAT_DEFAULT if barostat else MD_DEFAULT
