"""``mlipdd run``: molecular dynamics or a relaxation from flags, a config file, or nothing.

The run itself lives in `mlipdd.app` (settings, building, launching, summary); this module
only turns the command line into its settings. ``DESCRIPTION`` is what ``--help`` shows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mlipdd.app.output_errors import check_outputs_writable, write_error_message
from mlipdd.app.simulation import (
    DTYPES,
    ENSEMBLES,
    RunConfig,
    format_summary,
    run_simulation,
    strategy_names,
)
from mlipdd.data import InputError

DESCRIPTION = """\
Run molecular dynamics or a relaxation. With no arguments: the built-in demo, Lennard-Jones
argon, 4000 atoms, Langevin NVT at 94 K.

Settings come from the defaults, then --config FILE (YAML or JSON, the same names as the
flags with underscores, e.g. log_every: 5), then the flags given here. The time step and
temperature default to values that suit the system: 5 fs and 94 K for noble-gas fluids,
0.5 fs with hydrogen, otherwise 1 fs; 300 K otherwise.

With --nproc N the run is split over N local ranks (domain decomposition); under torchrun
or srun each launched process joins as one rank. --restart continues a checkpoint written
by --checkpoint on any number of ranks.

The thermo log uses LAMMPS' thermo_style custom names in metal units (press in bar);
--thermo picks its columns, --thermo-csv writes them all. A molecule or cluster without
a cell gets a non-periodic box with 10 A of vacuum (said in one line); a --system file
with several frames runs its first (--frame N another).

examples:
  mlipdd run --model lj --system fcc_argon --size 6 --ensemble nve --steps 500
  mlipdd run --ensemble npt --thermo "step temp pe press vol" --nproc 2
  mlipdd run --model mace --model-arg path=my.model --system water.xyz --ensemble npt
  mlipdd run --nproc 4 --thermo-csv thermo.csv && mlipdd plot thermo.csv
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run",
        help="run molecular dynamics or a relaxation (no arguments: a LJ argon demo)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The run flags. Defaults are SUPPRESSed so that only flags actually given override
    the config file; the real defaults live in `RunConfig`."""
    d = RunConfig().with_defaults()
    add = parser.add_argument
    s = argparse.SUPPRESS
    add("--config", default=s, metavar="FILE", help="YAML or JSON file with run settings")
    add("--model", default=s, help=f"registered model name (default {d.model})")
    add(
        "--model-arg",
        "--model-args",  # the config file's spelling (model_args) works as a flag too
        dest="model_arg",
        action="append",
        default=s,
        metavar="KEY=VALUE",
        help="keyword argument for the model factory; repeat for several (values parsed as JSON)",
    )
    from mlipdd.lattices import SYSTEMS

    add("--system", default=s, help=f"a built-in system ({', '.join(sorted(SYSTEMS))}) or a "
        f"structure file ASE reads (.xyz, .extxyz, .cif, POSCAR, ...); default {d.system}")
    add("--size", type=int, default=s, help="cells per axis (built-ins) or cell repeats (files)")
    add("--frame", type=int, default=s, metavar="N",
        help="which frame of a multi-frame --system file (default: the first; -1: the last)")
    add("--ensemble", choices=tuple(ENSEMBLES), default=s, metavar="NAME",
        help="; ".join(f"{name}: {text}" for name, text in ENSEMBLES.items())
        + f" (default {d.ensemble})")
    add("--steps", type=int, default=s, help=f"number of MD steps (default {d.steps})")
    add("--dt", type=float, default=s,
        help="time step in fs (default: 5 noble gases, 0.5 with hydrogen, else 1)")
    add("--temperature", type=float, default=s,
        help="K, thermostat target and starting velocities (default: 94 noble gases, else 300)")
    add("--pressure", type=float, default=s, help=f"bar, for npt and nph (default {d.pressure:g})")
    add("--tdamp", type=float, default=s, help="fs, thermostat time constant (default 100 steps)")
    add("--pdamp", type=float, default=s, help="fs, barostat time constant (default 1000 steps)")
    add("--fmax", type=float, default=s,
        help=f"eV/A, fire and fire2 stop when every force is below it (default {d.fmax:g})")
    add(
        "--friction",
        type=float,
        default=s,
        help=f"Langevin friction in 1/fs (default {d.friction})",
    )
    add("--seed", type=int, default=s, help="seed for velocities and Langevin noise")
    add("--trajectory", default=s, metavar="PATH", help="write frames here (.extxyz, .traj, ...)")
    add("--trajectory-every", type=int, default=s, help=f"default {d.trajectory_every}")
    add(
        "--log-every",
        type=int,
        default=s,
        help=f"thermo line every N steps, 0 for none (default {d.log_every})",
    )
    add("--log-file", default=s, metavar="PATH", help="thermo lines go to this file")
    add("--thermo-csv", default=s, metavar="PATH",
        help="also write the thermo records as CSV, every column (mlipdd plot draws them)")
    add("--thermo", default=s, metavar="COLUMNS",
        help="thermo log columns, LAMMPS thermo_style custom names (metal units), e.g. "
        "'step temp pe press'; from: step time sys pe ke etotal econs temp press press_gpa vol "
        "fmax imbalance (default: step time sys pe ke etotal econs temp press, + vol under npt/nph; "
        "fire: step sys pe fmax press)")
    add("--restart", default=s, metavar="FILE",
        help="continue from a checkpoint (written by --checkpoint), on any number of ranks, "
        "with its model, system, ensemble, dt, temperature and seed unless given; appends to "
        "--trajectory")
    add("--restart-allow-model-change", action="store_true", default=s,
        help="let --restart continue with another model (or changed weights) than the checkpoint's")
    add("--dtype", choices=sorted(DTYPES), default=s, help=f"default {d.dtype}")
    add("--device", default=s, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    add("--skin", type=float, default=s, help=f"neighbour-list skin in A (default {d.skin})")
    add("--progress", choices=("auto", "on", "off"), default=s,
        help="progress on stderr: a bar on a terminal, a plain line every 10 s otherwise "
        "(default on)")
    add(
        "--nproc",
        type=int,
        default=s,
        help="run on N local ranks with domain decomposition (under torchrun/srun ranks join)",
    )
    add("--strategy", choices=("auto", *strategy_names()), default=s,
        help="how ranks share the system: halo (ghost atoms), sharded (reads routed to owners) "
        "or graph_partition (for models that build their own graph); default auto: the model's "
        "preferred one (MACE, AIMNet2: sharded; others: halo)")
    add("--balance", choices=("count", "time"), default=s,
        help="move the cut planes at rebuilds: even atom counts, or even measured force time (CPU)")
    add("--cuda-graph", action="store_true", default=s,
        help="one rank on a CUDA device: replay the force call from a CUDA graph (small and "
        "medium systems, where kernel launches dominate)")
    add("--compile", nargs="?", const="inductor", default=s, metavar="BACKEND",
        help="run the force call through torch.compile (BACKEND default inductor; aot_eager traces "
        "without generating code), padded to caps so list rebuilds do not recompile; several ranks: "
        "models with per-atom energies (LJ, MACE) under halo storage, ghosts layers x cutoff deep")
    add("--grid", type=_grid, default=s, metavar="GX,GY,GZ", help="rank grid (default: least halo)")
    add("--checkpoint", default=s, metavar="PATH", help="write the full state here every "
        "--checkpoint-every steps, at the end, and when stopped by SIGTERM/SIGHUP/Ctrl-C")
    add("--checkpoint-every", type=int, default=s, help=f"default {d.checkpoint_every}")
    add(
        "--collective-timeout",
        type=float,
        default=s,
        metavar="SECONDS",
        help="with several ranks: how long a rank waits for the others in a collective before "
        f"the run fails (a suspended or wedged rank); default {d.collective_timeout:g}",
    )
    add("--json", action="store_true", help="print the summary as JSON")


def _grid(text: str) -> list[int]:
    try:
        grid = [int(x) for x in text.split(",")]
    except ValueError:
        grid = []
    if len(grid) != 3:
        raise argparse.ArgumentTypeError(f"{text!r} is not three integers such as 2,1,1")
    return grid


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"config file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"config file {path} is not valid JSON: {exc}") from None
    else:
        try:
            import yaml
        except ImportError:
            raise InputError(
                f"reading {path.name} needs PyYAML (pip install pyyaml); or write the config as JSON"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise InputError(f"config file {path} is not valid YAML{at}: {problem}") from None
    if not isinstance(data, dict):
        raise InputError(
            f"config file {path} must hold a mapping of settings, got {type(data).__name__}"
        )
    return data


def parse_model_args(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"--model-arg {item!r} is not KEY=VALUE; e.g. --model-arg cutoff=6.0")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value  # a plain string (a path, a name)
    return out


def _config_model_args(settings: dict[str, Any]) -> dict[str, Any]:
    """The config file's ``model_args`` (a mapping, the documented name); ``model_arg``,
    the flag's spelling, is accepted too, as a mapping or a list of KEY=VALUE strings."""
    merged: dict[str, Any] = {}
    for key in ("model_arg", "model_args"):
        value = settings.pop(key, None)
        if value is None:
            continue
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = parse_model_args(value)
        if not isinstance(value, dict):
            raise InputError(f"setting {key}: {value!r} is not a mapping of model arguments; "
                             "e.g. model_args: {cutoff: 6.0}")
        merged.update(value)
    return merged


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Defaults < config file < flags; ``model_args`` merge key by key."""
    given = {k: v for k, v in vars(args).items() if k not in ("func", "json")}
    settings: dict[str, Any] = {}
    if "config" in given:
        settings.update(
            {str(k).replace("-", "_"): v for k, v in load_config_file(given.pop("config")).items()}
        )
    model_args = _config_model_args(settings)
    model_args.update(parse_model_args(given.pop("model_arg", [])))
    settings.update(given)
    settings["model_args"] = model_args
    return RunConfig.from_mapping(settings)


def run(args: argparse.Namespace) -> int:
    from mlipdd.app.launch import launched_world_size, run_command

    cfg = config_from_args(args)
    if launched_world_size() == 1:  # here, before any rank starts (torchrun's: mid-run, below)
        check_outputs_writable(cfg)
    if cfg.nproc > 1 or launched_world_size() > 1:
        return run_command(cfg, json_output=args.json)
    from mlipdd.app.simulation import stopped_message
    from mlipdd.dynamics.stop import RunStopped, stop_on_signals

    try:
        with stop_on_signals():  # SIGTERM / SIGHUP / Ctrl-C: stop after the step, write files
            summary = run_simulation(cfg)
    except RunStopped as exc:
        print(stopped_message(cfg, exc), file=sys.stderr, flush=True)
        return exc.exit_code
    except InputError as exc:  # bad input or a blow-up: the message says it all
        print(f"mlipdd run: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:  # a full disk mid-run: one line naming the file; else a bug
        message = write_error_message(exc, cfg)
        if message is None:
            raise
        print(f"mlipdd run: error: {message}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
    return 0
