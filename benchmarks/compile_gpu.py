"""Medium MACE (e3nn) on one GPU: eager vs compiled vs CUDA-graphed, force call and MD step.

    python benchmarks/compile_gpu.py --sizes 1000,4096 --steps 200

For each size, float32, at one rank:

* ``bare ms``: raw mace on a prebuilt input dict (energy + forces);
* per force call (``eager``, ``compiled`` = ``DomainConfig(compile=True)`` with inductor,
  ``graphed`` = ``cuda_graph=True``): `DistributedModel` ms per call (median), the largest
  |dF| against the eager call, and for the compiled one the compile seconds and graphs;
* ``MD steps/s``: NVE under `DomainParallel` at one rank (what ``mlipdd run --compile`` /
  ``--cuda-graph`` runs: Verlet list with a 0.5 A skin, rebuilds), ``--steps`` steps after
  20 warm-up steps, with the rebuilds and the recompiles / recaptures of the timed steps.

A mode that fails is printed and left as ``failed`` in its row; the other rows still run.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch
from _common import median_time, write_results
from memory_wall import medium_model, si
from mlipdd.distributed import DistributedModel, DomainConfig, DomainParallel
from mlipdd.dynamics import NVE
from mlipdd.dynamics.velocities import initialize_velocities
from mlipdd.neighbors import attach_neighbors
from mlipdd_mace import MACEWrapper

SKIN = 0.5
MODES = {"eager": {}, "compiled": {"compile": True}, "graphed": {"cuda_graph": True}}
DEVICE = "cuda"  # --device cpu: a smoke run of this script (with --backend aot_eager, no graphed mode)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def counters(dm) -> int:
    stats = dm.compile_stats
    return stats["compiles"] if stats is not None else dm.cuda_graph_captures


def bare_ms(raw, n, repeats):
    wrapper = MACEWrapper(raw)
    batch = si(n, DEVICE)
    attach_neighbors(batch, wrapper.cutoff)
    data = wrapper.adapt_input(batch)

    def bare():
        data["positions"].requires_grad_(True)
        raw(data, training=False, compute_force=True)

    return 1e3 * median_time(bare, repeats, warmup=3, sync=sync), batch.num_atoms


def force_call(dm, n, repeats):
    """ms per energy + forces call; the first call (the compile or capture) timed apart."""
    owned = dm.partition(si(n, DEVICE))
    sync()
    start = time.perf_counter()
    forces = dm(owned)["forces"]
    sync()
    first = time.perf_counter() - start
    ms = 1e3 * median_time(lambda: dm(owned), repeats, warmup=3, sync=sync)
    return forces, ms, first


def md(dm, n, steps):
    """The same DistributedModel (its compiled graph or captured graph) driving NVE."""
    full = si(n, DEVICE)
    initialize_velocities(full, 300.0, seed=1)
    with DomainParallel(NVE(dm, 1.0), n_steps=20) as dp:
        dp.partition(full)
        dp.run()  # warm-up: first rebuild
        sync()
        before, rebuilds = counters(dm), dp.strategy.rebuilds
        dp.n_steps = steps
        t0 = time.perf_counter()
        dp.run()
        sync()
        rate = steps / (time.perf_counter() - t0)
        return rate, dp.strategy.rebuilds - rebuilds, counters(dm) - before


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="1000,4096")
    p.add_argument("--modes", default="eager,compiled,graphed")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--machine", default="")
    p.add_argument("--name", default="compile_gpu")
    p.add_argument("--device", default="cuda")
    p.add_argument("--cueq", action="store_true", help="mace's convert_e3nn_cueq of the model (fused conv)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled mode")
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    MODES["compiled"]["compile_backend"] = args.backend
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        raw = medium_model(DEVICE)
        if args.cueq:
            from mace.cli.convert_e3nn_cueq import run as to_cueq

            raw = to_cueq(raw, device=DEVICE).to(DEVICE).eval()
        bare, atoms = bare_ms(raw, n, args.repeats)
        eager_forces = None
        for mode in args.modes.split(","):
            row = {"atoms": atoms, "mode": mode, "bare ms": bare}
            try:
                wrapper = MACEWrapper(raw)
                dm = DistributedModel(wrapper, DomainConfig(cutoff=wrapper.cutoff, skin=SKIN, **MODES[mode]))
                forces, ms, first = force_call(dm, n, args.repeats)
                eager_forces = forces if mode == "eager" else eager_forces
                row.update({"dm ms": ms, "first call s": first})
                if eager_forces is not None:
                    row["max dF"] = float((forces - eager_forces).abs().max())
                rate, rebuilds, again = md(dm, n, args.steps)
                row.update({"MD steps/s": rate, "rebuilds": rebuilds, "recompiles/recaptures": again})
                if dm.compile_stats is not None:
                    stats = dm.compile_stats
                    row.update({"compile s": stats["compile_seconds"], "graphs": stats["graphs"]})
            except Exception as error:  # noqa: BLE001 - keep the other rows
                print(f"{n} {mode} failed: {type(error).__name__}: {error}"[:600], flush=True)
                row["dm ms"] = "failed"
            print(row, flush=True)
            rows.append(row)
            write(args, rows)  # after every row: a run stopped by its time limit keeps what it measured
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        del raw
    print(write(args, rows))


def write(args, rows) -> str:
    columns = ["atoms", "mode", "bare ms", "dm ms", "max dF", "first call s", "compile s", "graphs", "MD steps/s",
               "rebuilds", "recompiles/recaptures"]
    return write_results(args.name, f"Medium MACE {'cuEq' if args.cueq else 'e3nn'} on one GPU: eager vs compile=True vs cuda_graph=True", rows,
                         columns, notes=f"{args.machine}\n\nfloat32, diamond Si at 300 K, random weights, dt 1 fs, "
                        f"skin {SKIN} A. Force calls: median of {args.repeats} (energy + forces, no stress) after the "
                        "first call (the compile or capture, timed apart); max dF against the eager call. MD: the "
                        f"same DistributedModel driving NVE under DomainParallel at one rank, {args.steps} steps after "
                        "20 warm-up steps; rebuilds and recompiles / recaptures of the timed steps; compile s and "
                        "graphs over the whole row.")


if __name__ == "__main__":
    main()
