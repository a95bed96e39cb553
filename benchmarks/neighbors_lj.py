"""Neighbour-list build and Lennard-Jones energy+forces on FCC argon, 1k to 108k atoms.

    OMP_NUM_THREADS=2 python benchmarks/neighbors_lj.py --sizes 6 10 16 20 25 30 --repeats 5

Sizes are FCC repetitions n (4 n^3 atoms). For each size the runner times, after one
warm-up, the median of ``--repeats`` runs of (a) `build_neighbor_list` and (b) one LJ
energy + autograd forces with the list already attached. "atom-steps/s" counts one MD
step as a neighbour-list build plus one force evaluation (no skin reuse), so it is a
lower bound on what an MD loop with a skin achieves.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path

import torch
from _common import machine as base_machine
from ase.build import bulk
from mlipdd.data import AtomicData
from mlipdd.models.lj import LennardJones
from mlipdd.neighbors import build_neighbor_list

EPSILON, SIGMA, LATTICE = 0.0104, 3.40, 5.26  # argon: eV, Angstrom, Angstrom
CUTOFF = 2.5 * SIGMA
RESULTS = Path(__file__).parent / "results"


def argon(repeat: int, device: str, dtype: torch.dtype) -> AtomicData:
    atoms = bulk("Ar", "fcc", a=LATTICE, cubic=True).repeat((repeat, repeat, repeat))
    atoms.rattle(0.05, seed=repeat)
    return AtomicData.from_ase(atoms, dtype=dtype, device=device)


def timed(fn, device: str, repeats: int) -> tuple[float, object]:
    """Median wall time in ms of ``fn()`` after one warm-up call, and its last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), result


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def machine(device: str) -> dict:
    info = {**base_machine(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "device": device}
    try:
        import vesin_torch

        info["vesin_torch"] = vesin_torch.__version__
    except ImportError:
        pass
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def run(sizes, repeats, device, dtype) -> list[dict]:
    model = LennardJones(epsilon=EPSILON, sigma=SIGMA, cutoff=CUTOFF).to(device)
    model.eval()  # no double-backward graph: the MD setting
    rows = []
    for n in sizes:
        data = argon(n, device, dtype)
        nl_ms, neighbors = timed(
            functools.partial(build_neighbor_list, data, CUTOFF), device, repeats
        )
        data.neighbors = neighbors
        lj_ms, _ = timed(functools.partial(model, data), device, repeats)
        row = {
            "atoms": data.num_atoms,
            "edges": neighbors.num_edges,
            "nl_ms": nl_ms,
            "lj_ms": lj_ms,
            "atom_steps_per_s": data.num_atoms / ((nl_ms + lj_ms) * 1e-3),
        }
        rows.append(row)
        print(markdown_row(row), flush=True)
    return rows


HEADER = "| atoms | edges | NL ms | LJ ms (E+F) | atom-steps/s |\n|---:|---:|---:|---:|---:|"


def markdown_row(r: dict) -> str:
    return (
        f"| {r['atoms']:,} | {r['edges']:,} | {r['nl_ms']:.1f} | {r['lj_ms']:.1f} | "
        f"{r['atom_steps_per_s']:.3g} |"
    )


def run_record(rows, info, args) -> dict:
    where = info.get("gpu") or (
        f"{info['cpu']} ({info['cores']} cores, {info['torch_threads']} threads)"
    )
    threads = f"OMP_NUM_THREADS={info['OMP_NUM_THREADS']} " if info["OMP_NUM_THREADS"] else ""
    command = (
        f"{threads}python benchmarks/neighbors_lj.py --sizes {' '.join(map(str, args.sizes))} "
        f"--repeats {args.repeats} --device {args.device} --dtype {args.dtype}"
    )
    return {
        "label": f"{where}, {args.device}, {args.dtype}",
        "command": command,
        "machine": info,
        "cutoff": CUTOFF,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "note": args.note,
        "rows": rows,
    }


def write_results(record: dict, output: Path) -> None:
    """Add ``record`` to the results file, replacing an earlier run with the same label.

    One file keeps every machine's table (the CPU run here, GPU runs on the device
    machine); the markdown is regenerated from the JSON each time.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = output.with_suffix(".json"), output.with_suffix(".md")
    runs = []
    if json_path.exists():
        runs = json.loads(json_path.read_text()).get("runs", [])
    runs = [r for r in runs if r["label"] != record["label"]] + [record]
    json_path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    lines = [
        "# Neighbour list + Lennard-Jones on FCC argon",
        "",
        (
            f"Argon, a = {LATTICE} A, rattled 0.05 A, cutoff 2.5 sigma = {CUTOFF:.2f} A, full "
            "list (vesin via `mlipdd.neighbors.build_neighbor_list`, sorted edges). NL = list "
            "build; LJ = energy + autograd forces with the list attached; atom-steps/s = "
            "atoms / (NL + LJ), i.e. a rebuild every step (a skin makes MD faster). Median of "
            "the repeats after one warm-up."
        ),
        "",
    ]
    for r in runs:
        meta = ", ".join(f"{k}: {v}" for k, v in r["machine"].items() if v is not None)
        lines += [f"## {r['label']}", "", f"`{r['command']}`", "", f"Machine: {meta}.", ""]
        if r["note"]:
            lines += [r["note"], ""]
        lines += [HEADER] + [markdown_row(row) for row in r["rows"]] + [""]
    md_path.write_text("\n".join(lines))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[6, 10, 16, 20, 25, 30],
                        help="FCC repetitions n (4 n^3 atoms)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--output", type=Path, default=RESULTS / "neighbors_lj.md")
    parser.add_argument(
        "--note", default="", help="a line for the results file (shared machine...)"
    )
    args = parser.parse_args(argv)
    info = machine(args.device)
    print(f"# {info}\n{HEADER}", flush=True)
    rows = run(args.sizes, args.repeats, args.device, getattr(torch, args.dtype))
    write_results(run_record(rows, info, args), args.output)
    print(f"wrote {args.output.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
