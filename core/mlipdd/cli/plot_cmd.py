"""``mlipdd plot thermo.csv``: energy, temperature and (when it changes) volume vs time."""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

from mlipdd.data import InputError

# the columns drawn, by their CSV names (LAMMPS keywords); a CSV written before they were
# renamed (epot, etot, temperature, volume) is read too
_NEEDED = ("time_ps", "system", "pe", "etotal", "econs", "temp", "vol")
_OLD_NAMES = {"epot": "pe", "etot": "etotal", "temperature": "temp", "volume": "vol"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plot",
        help="plot a thermo CSV (mlipdd run --thermo-csv) as a PNG",
        description="Plot energy, temperature and, when the cell changes (NPT, NPH), volume "
        "against time from the CSV thermo log of mlipdd run. Needs matplotlib "
        "(pip install 'mlipdd[plot]').",
    )
    parser.add_argument("csv", metavar="THERMO_CSV", help="the CSV thermo log")
    parser.add_argument("-o", "--output", metavar="PNG",
                        help="image to write (default: the CSV's name with .png)")
    parser.set_defaults(func=run)
    return parser


def read_thermo(path: Path) -> dict[int, dict[str, list[float]]]:
    """Columns per system: ``{system: {column: values}}``."""
    if not path.is_file():
        raise InputError(f"{str(path)!r} does not exist; give the CSV written by mlipdd run --thermo-csv")
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        reader.fieldnames = [_OLD_NAMES.get(name, name) for name in reader.fieldnames or ()]
        missing = [c for c in _NEEDED if c not in reader.fieldnames]
        if missing:
            raise InputError(f"{path} lacks the thermo columns {missing}; is it a thermo CSV of mlipdd run?")
        systems: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for row in reader:
            for column in _NEEDED:
                systems[int(row["system"])][column].append(float(row[column]))
    if not systems:
        raise InputError(f"{path} holds no rows yet; run longer or log more often (--log-every)")
    return systems


def plot_thermo(path: Path, output: Path) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise InputError("mlipdd plot needs matplotlib: pip install 'mlipdd[plot]'") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    systems = read_thermo(path)
    volume_changes = any(max(c["vol"]) - min(c["vol"]) > 1e-9 * max(c["vol"])
                         for c in systems.values())
    panels = 3 if volume_changes else 2
    fig, axes = plt.subplots(panels, 1, sharex=True, figsize=(7, 2.6 * panels))
    for system, c in sorted(systems.items()):
        tag = f" (system {system})" if len(systems) > 1 else ""
        axes[0].plot(c["time_ps"], c["pe"], label=f"potential{tag}")
        axes[0].plot(c["time_ps"], c["etotal"], label=f"total{tag}")
        axes[0].plot(c["time_ps"], c["econs"], "--", label=f"conserved{tag}")
        axes[1].plot(c["time_ps"], c["temp"], label=f"T{tag}")
        if volume_changes:
            axes[2].plot(c["time_ps"], c["vol"], label=f"V{tag}")
    axes[0].set_ylabel("energy (eV)")
    axes[0].legend(fontsize="small")
    axes[1].set_ylabel("temperature (K)")
    if volume_changes:
        axes[2].set_ylabel("volume (A^3)")
    axes[-1].set_xlabel("time (ps)")
    fig.suptitle(path.name)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def run(args: argparse.Namespace) -> int:
    path = Path(args.csv)
    output = Path(args.output) if args.output else path.with_suffix(".png")
    print(f"wrote {plot_thermo(path, output)}")
    return 0
