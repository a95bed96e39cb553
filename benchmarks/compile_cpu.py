"""DomainConfig(compile=True) on CPU: eager vs compiled force call and MD step, LJ and a small MACE.

    python benchmarks/compile_cpu.py --backends aot_eager,inductor --steps 300

Per model and backend, at one rank, float64:

* ``force call``: `DistributedModel` eager and compiled, median ms per energy + forces call
  (the compiled one at its caps, padding included), and the largest |dF| between them;
* ``compile s``: wall time of the calls that compiled (both stress flags), ``graphs`` the
  graphs the backend built (1 per compile: no graph break);
* ``MD``: the same `DistributedModel` driving NVE under `DomainParallel` at one rank (what
  ``mlipdd run --compile`` runs), steps/s after a warm-up, with the neighbour-list rebuilds
  and the recompiles of the timed steps.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch
from _common import median_time, write_results
from mlipdd.distributed import DistributedModel, DomainConfig, DomainParallel
from mlipdd.dynamics import NVE
from mlipdd.dynamics.velocities import initialize_velocities
from mlipdd.lattices import lj_liquid
from mlipdd.models.lj import LennardJones

SKIN = 0.5


def models():
    from mlipdd_mace.testing import random_mace
    from mlipdd_mace.wrapper import MACEWrapper

    lj = LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.5)
    mace = MACEWrapper(random_mace(elements=(18,), r_max=5.0, channels=16, max_ell=2, correlation=2))
    return {"lj": (lj, lambda: lj_liquid(6, temperature=300.0, seed=3)),
            "mace small": (mace, lambda: lj_liquid(4, temperature=300.0, seed=3))}


def config(model, backend):
    extra = {} if backend == "eager" else {"compile": True, "compile_backend": backend}
    return DomainConfig(cutoff=model.cutoff, skin=SKIN, **extra)


def force_call(dm, system, repeats):
    """ms per energy + forces call; the first calls (with and without stress: the compiles) apart."""
    owned = dm.partition(system())
    start = time.perf_counter()
    first = dm(owned)
    dm(owned, compute_stress=True)
    warm = time.perf_counter() - start
    ms = 1e3 * median_time(lambda: dm(owned), repeats, warmup=2)
    return first["forces"], ms, warm


def md(dm, system, steps):
    """The same DistributedModel (its compiled graphs) driving NVE."""
    full = system()
    initialize_velocities(full, 300.0, seed=1)
    with DomainParallel(NVE(dm, 2.0), n_steps=20) as dp:
        dp.partition(full)
        dp.run()  # warm-up
        before = (dm.compile_stats or {}).get("compiles", 0)
        rebuilds = dp.strategy.rebuilds
        dp.n_steps = steps
        t0 = time.perf_counter()
        dp.run()
        rate = steps / (time.perf_counter() - t0)
        after = (dm.compile_stats or {}).get("compiles", 0)
        return rate, dp.strategy.rebuilds - rebuilds, after - before


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backends", default="aot_eager,inductor")
    p.add_argument("--models", default="lj,mace small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--name", default="compile_cpu")
    args = p.parse_args(argv)
    torch.set_default_dtype(torch.float64)
    rows = []
    for name, (model, system) in models().items():
        if name not in args.models.split(","):
            continue
        eager = DistributedModel(model, config(model, "eager"))
        eager_forces, eager_ms, _ = force_call(eager, system, args.repeats)
        eager_md, rebuilds, _ = md(eager, system, args.steps)
        rows.append({"model": name, "atoms": system().num_atoms, "force call": "eager", "ms": eager_ms,
                     "MD steps/s": eager_md, "rebuilds": rebuilds})
        print(rows[-1], flush=True)
        for backend in args.backends.split(","):
            dm = DistributedModel(model, config(model, backend))
            forces, ms, warm = force_call(dm, system, args.repeats)
            rate, rebuilds, recompiles = md(dm, system, args.steps)
            stats = dm.compile_stats
            rows.append({"model": name, "atoms": system().num_atoms, "force call": backend, "ms": ms,
                         "max dF": float((forces - eager_forces).abs().max()), "compile s": stats["compile_seconds"],
                         "first calls s": warm, "graphs": stats["graphs"], "MD steps/s": rate,
                         "rebuilds": rebuilds, "MD recompiles": recompiles})
            print(rows[-1], flush=True)
    columns = ["model", "atoms", "force call", "ms", "max dF", "compile s", "first calls s", "graphs", "MD steps/s",
               "rebuilds", "MD recompiles"]
    print(write_results(args.name, "compile=True on CPU: eager vs compiled force call and MD step (one rank)", rows,
                        columns, notes=f"float64, liquid argon at 300 K, skin {SKIN} A; force call: median of "
                        f"{args.repeats} after two warm-up calls (energy + forces); compile s: the calls that compiled "
                        "(stress and no stress); MD: NVE under DomainParallel at one rank, "
                        f"{args.steps} steps after 20 warm-up steps, rebuilds and recompiles of the timed steps. "
                        "mace small: random weights, 16 channels, max_ell 2, correlation 2, r_max 5 A. "
                        "2 shared cores, one thread: times are noisy."))


if __name__ == "__main__":
    main()
