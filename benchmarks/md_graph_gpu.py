"""Medium MACE MD on one GPU: eager vs CUDA-graphed, e3nn vs cuEquivariance, against bare mace.

    python benchmarks/md_graph_gpu.py --sizes 1000,4096,27000 --backends e3nn,cueq --steps 200

For each size and tensor-product backend (``cueq``: mace's own `convert_e3nn_cueq`):

* ``bare force call``: raw mace on a prebuilt input dict (energy + forces), and the same
  call captured in a CUDA graph by hand (the floor of launch cost);
* ``dm force call``: `DistributedModel` at one rank, eager and ``cuda_graph=True``;
* ``MD step``: NVE under `DomainParallel` at one rank (the path `mlipdd run` takes: a
  Verlet list with a 0.5 A skin, rebuilds, NaN checks, the integrator), eager and graphed,
  as steps/s over ``--steps`` steps after a warm-up.

compile=True is measured beside eager and graphed in `benchmarks/compile_gpu.py`.
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
from mace_small import bare_graphed
from memory_wall import medium_model, si
from mlipdd.distributed import DistributedModel, DomainConfig, DomainParallel
from mlipdd.dynamics import NVE
from mlipdd.dynamics.velocities import initialize_velocities
from mlipdd.neighbors import attach_neighbors
from mlipdd_mace import MACEWrapper

SKIN = 0.5


def mace_model(backend: str, device: str):
    raw = medium_model(device)
    if backend == "cueq":
        from mace.cli.convert_e3nn_cueq import run as to_cueq

        raw = to_cueq(raw, device=device).to(device).eval()
    return raw


def force_calls(raw, n, repeats, device):
    """ms per energy + forces call: bare, bare graphed, dm eager, dm graphed."""
    wrapper = MACEWrapper(raw)
    batch = si(n, device)
    attach_neighbors(batch, wrapper.cutoff)
    data = wrapper.adapt_input(batch)

    def bare():
        data["positions"].requires_grad_(True)
        raw(data, training=False, compute_force=True)

    calls = {"bare": bare, "bare graphed": bare_graphed(raw, data)}
    for graphed in (False, True):
        dm = DistributedModel(wrapper, DomainConfig(cutoff=wrapper.cutoff, skin=SKIN, cuda_graph=graphed))
        owned = dm.partition(batch)
        calls["dm graphed" if graphed else "dm eager"] = lambda dm=dm, owned=owned: dm(owned)
    sync = torch.cuda.synchronize
    return {name: 1e3 * median_time(fn, repeats, warmup=3, sync=sync) for name, fn in calls.items()}, batch.num_atoms


def md_steps_per_second(raw, n, steps, device, graphed):
    wrapper = MACEWrapper(raw)
    full = si(n, device)
    initialize_velocities(full, 300.0, seed=1)
    dm = DistributedModel(wrapper, DomainConfig(cutoff=wrapper.cutoff, skin=SKIN, cuda_graph=graphed))
    with DomainParallel(NVE(dm, 1.0), n_steps=20) as dp:
        dp.partition(full)
        dp.run()  # warm-up: first rebuild, capture
        torch.cuda.synchronize()
        dp.n_steps = steps
        t0 = time.perf_counter()
        dp.run()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        return steps / elapsed, dm.cuda_graph_captures, dp.strategy.rebuilds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="1000,4096,27000")
    p.add_argument("--backends", default="e3nn,cueq")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--machine", default="")
    p.add_argument("--name", default="md_graph_gpu")
    args = p.parse_args(argv)
    rows = []
    for backend in args.backends.split(","):
        for n in (int(s) for s in args.sizes.split(",")):
            raw = mace_model(backend, "cuda")
            calls, atoms = force_calls(raw, n, args.repeats, "cuda")
            row = {"backend": backend, "atoms": atoms, **{f"{k} ms": v for k, v in calls.items()}}
            for graphed in (False, True):
                key = "graphed" if graphed else "eager"
                try:
                    rate, captures, rebuilds = md_steps_per_second(raw, n, args.steps, "cuda", graphed)
                except Exception as error:  # noqa: BLE001 - keep the other rows
                    print(f"{backend} {n} MD {key} failed: {type(error).__name__}: {error}"[:400], flush=True)
                    rate, captures, rebuilds = float("nan"), "failed", ""
                row[f"MD {key} steps/s"] = rate
                if graphed:
                    row["captures"], row["rebuilds"] = captures, rebuilds
            print(row, flush=True)
            rows.append(row)
            del raw
            gc.collect()
            torch.cuda.empty_cache()
    columns = ["backend", "atoms", "bare ms", "bare graphed ms", "dm eager ms", "dm graphed ms",
               "MD eager steps/s", "MD graphed steps/s", "captures", "rebuilds"]
    print(write_results(args.name, "Medium MACE MD on one GPU: eager vs CUDA graph, e3nn vs cuEq", rows, columns,
                        notes=f"{args.machine}\n\nfloat32, diamond Si at 300 K, random weights, dt 1 fs, skin "
                              f"{SKIN} A. Force calls: median of {args.repeats}. MD: NVE under DomainParallel "
                              f"at one rank (what `mlipdd run` runs), {args.steps} steps after 20 warm-up "
                              "steps; captures and rebuilds count the whole graphed run."))


if __name__ == "__main__":
    main()
