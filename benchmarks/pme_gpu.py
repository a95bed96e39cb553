"""PME (distributed mesh, gloo ranks sharing the GPU) and torch-pme on one GPU, up to 1M atoms
(issue 26 items 5, 7; D3 on the GPU: benchmarks/d3_memory.py).

    python benchmarks/pme_gpu.py --sizes 10000,100000,1000000 --rows pme,pme_dist_1,pme_dist_2,torchpme

Rows (each in its own process, so an out-of-memory or a stall stops only that row):

* ``pme_dist_N``: `DistributedModel(PMEWrapper(mesh="distributed"))` with N gloo ranks sharing
  the GPU (the slowest rank's seconds, the largest rank's peak); ``pme_repl_N`` the same with
  the whole mesh on every rank (``mesh="replicated"``, torch splines);
* ``pme``: `PMEWrapper` at one process (no DistributedModel), list prebuilt;
* ``torchpme``: torch-pme's `PMECalculator` at the same splitting and mesh spacing,
  4-point Lagrange interpolation, a precomputed half list, one process.

Rattled rock salt (Na+/Cl-, tilted cell), float32 on CUDA, energy + forces per call (median of
3 after a warm-up, synchronised). PME: the splitting of an 8 A cutoff at accuracy 1e-4 (the
mesh from the error estimate).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import pathlib
import subprocess
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch
from _common import RESULTS, torchpme_step, write_results

CUTOFF, ACCURACY = 8.0, 1e-4
DEVICE = os.environ.get("LONG_RANGE_DEVICE", "cuda")  # the spawned ranks read it too; --device sets it


def _system(n_atoms):
    from mlipdd_ewald_pme.testing import rock_salt

    cells = max(1, round((n_atoms / 8) ** (1 / 3)))
    return rock_salt((cells, cells, cells), rattle=0.1, seed=0).to(dtype=torch.float32)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _peak():
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None


def _timed(call):
    call()
    times = []
    for _ in range(3):
        _sync()
        start = time.perf_counter()
        out = call()
        _sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[1], out


def _pme(mesh="replicated"):
    from mlipdd_ewald_pme.wrappers import PMEWrapper

    return PMEWrapper(cutoff=CUTOFF, accuracy=ACCURACY, mesh=mesh)


def one_process(kind, n):
    from mlipdd.neighbors import attach_neighbors

    batch = _system(n).to(DEVICE)
    if kind == "pme":
        model = _pme()
        attach_neighbors(batch, CUTOFF)
        seconds, out = _timed(lambda: model(batch))
        return {"seconds": seconds, "peak_GiB": _peak(), "energy": float(out["energy"].sum()),
                "mesh": "x".join(map(str, model.mesh_dimensions(batch.cell)[0]))}
    if kind == "torchpme":
        return _torchpme(batch)
    raise ValueError(kind)


def _torchpme(batch):
    model = _pme()
    spacing = max(float(batch.cell[0].norm(dim=1).max()) / d for d in model.mesh_dimensions(batch.cell)[0])
    step = torchpme_step(batch, CUTOFF, model.alpha, spacing)
    seconds, energy = _timed(step)
    return {"seconds": seconds, "peak_GiB": _peak(), "energy": float(energy)}


def _stack_dumps(rank):
    """``PME_GPU_STACKS=DIR``: each rank writes its Python stack to DIR/pme_stack_rank<r>.txt
    every ``PME_GPU_STACK_EVERY`` seconds (default 20): a stalled rank shows where it waits,
    a slow one shows its progress (the parent's own dump covers only the launcher). Returns
    ``mark(label)``, which writes the seconds since the rank started next to a phase's name."""
    folder, start = os.environ.get("PME_GPU_STACKS"), time.perf_counter()
    if not folder:
        return lambda label: None
    pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
    sink = open(pathlib.Path(folder) / f"pme_stack_rank{rank}.txt", "a")  # noqa: SIM115 - open while the rank runs
    faulthandler.dump_traceback_later(float(os.environ.get("PME_GPU_STACK_EVERY", "20")), repeat=True, file=sink)

    def mark(label):
        print(f"[{time.perf_counter() - start:8.2f} s] {label}", file=sink, flush=True)
    return mark


def _rank(rank, world_size, batch, mesh):
    from mlipdd.distributed import DistributedModel, DomainConfig

    mark = _stack_dumps(rank)
    model = _pme(mesh)
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.0))
    # on DEVICE: gloo ranks place rows where the model's parameters live, and PMEWrapper has none
    # (the session-10 rows, 'no result', ran on the CPU: 4.4 s per call at 97k atoms)
    owned = dm.partition(batch if rank == 0 else None, device=torch.device(DEVICE))
    mark("partitioned")
    dm(owned)  # builds the halo
    mark("first call (halo built)")
    times = []
    for _ in range(3):
        torch.distributed.barrier()
        _sync()
        start = time.perf_counter()
        out = dm(owned)
        _sync()
        times.append(time.perf_counter() - start)
        mark(f"timed call {times[-1]:.3f} s")
    faulthandler.cancel_dump_traceback_later()
    return {"seconds": sorted(times)[1], "peak_GiB": _peak(), "energy": float(out["energy"][0]),
            "mesh": "x".join(map(str, model.mesh_dimensions(owned.cell)[0]))}


def distributed(kind, n, timeout):
    from mlipdd.testing import run_ranks

    mesh, ranks = ("distributed" if kind.startswith("pme_dist") else "replicated"), int(kind.rsplit("_", 1)[1])
    # the first call's mesh search (accurate_mesh: float64 on the host) runs on the rank's CPU
    # threads: at one thread per rank it takes minutes at 1M ions, so the cores are shared out
    threads = max(1, (os.cpu_count() or 1) // ranks) if DEVICE == "cuda" else 1
    results = run_ranks(_rank, ranks, _system(n), mesh, timeout=timeout, threads=threads)
    return {"seconds": max(r["seconds"] for r in results), "peak_GiB": max(r["peak_GiB"] or 0 for r in results),
            "energy": results[0]["energy"], "mesh": results[0]["mesh"]}


LABELS = {"pme": "PME (PMEWrapper default spline)", "torchpme": "torch-pme PME"}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        _, _, kind, n, timeout = sys.argv
        faulthandler.dump_traceback_later(float(timeout) + 30, exit=True)  # a stall prints its stack
        row = distributed(kind, int(n), float(timeout)) if kind.startswith("pme_") else one_process(kind, int(n))
        print(json.dumps(row), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10000,100000,1000000")
    p.add_argument("--rows", default="pme,pme_dist_1,pme_dist_2,torchpme")
    p.add_argument("--row-timeout", type=float, default=150.0)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    p.add_argument("--machine", default="")
    p.add_argument("--name", default="pme_gpu")
    p.add_argument("--out-dir", type=pathlib.Path, default=RESULTS)
    args = p.parse_args()
    os.environ["LONG_RANGE_DEVICE"] = args.device
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for kind in args.rows.split(","):
            cmd = [sys.executable, __file__, "one", kind, str(n), str(args.row_timeout)]
            start = time.perf_counter()
            try:
                proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                                      timeout=args.row_timeout + 60)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                row = json.loads(lines[-1]) if lines else {
                    "status": "out of memory" if "OutOfMemoryError" in proc.stderr else proc.stderr.strip()[-300:]}
            except subprocess.TimeoutExpired as stalled:
                row = {"status": f"no result in {args.row_timeout + 60:.0f} s: {str(stalled.stderr or '')[-300:]}"}
            ranks = kind.rsplit("_", 1)[1] if kind.startswith("pme_") else "1 process"
            label = LABELS.get(kind) or f"PME {'distributed' if 'dist' in kind else 'replicated'} mesh"
            row = {"atoms": _system_atoms(n), "model": label, "how": ranks if ranks == "1 process" else
                   f"DistributedModel, {ranks} gloo rank(s)", **row, "wall_s": time.perf_counter() - start}
            row.setdefault("status", "ok")
            rows.append(row)
            print(json.dumps(row), flush=True)
    notes = f"{args.machine}\n\n" + __doc__.split("\n\n", 2)[2]
    print(write_results(args.name, "PME (distributed mesh) and torch-pme on one GPU", rows,
                        ["atoms", "model", "how", "mesh", "seconds", "peak_GiB", "energy", "status", "wall_s"],
                        notes=notes, out_dir=args.out_dir))


def _system_atoms(n):
    cells = max(1, round((n / 8) ** (1 / 3)))
    return 8 * cells**3  # before vacancies (rock_salt removes none by default)


if __name__ == "__main__":
    main()
