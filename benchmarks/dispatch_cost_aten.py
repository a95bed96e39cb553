"""Eager cost of the aten-level dispatch vs the torch-function one, per force call (CPU).

    python benchmarks/dispatch_cost_aten.py [--atoms 1000] [--repeats 7]

LJ (argon, cutoff 8.5 A, ~1000 atoms, float64, forces + stress), one thread per rank:

* ``plain``: the model alone;
* 1 rank: ``torch_function`` (the old dispatch: at one rank the model gets plain
  tensors, NOTE [one rank], so it measures the strategy's bookkeeping) and ``aten``
  (the aten ShardTensor is active at one rank too: every op goes through its rules);
* 2 ranks (spawned gloo ranks, both dispatches active): rank 0's median.

Rows go to results/dispatch_cost_aten.json and the table to results/dispatch_cost_aten.md.
Not a timed test: the machine is shared, so read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch
from _common import RESULTS, machine, median_time


def _lj():
    from mlipdd.models.lj import LennardJones

    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.5)


def _system(n_atoms: int):
    from mlipdd.testing.systems import cubic

    return cubic(reps=max(2, round(n_atoms ** (1 / 3))))


def _median_ms(fn, repeats: int, barrier=None) -> float:
    return 1e3 * median_time(fn, repeats, warmup=2, sync=barrier)


def one_process(n_atoms: int, repeats: int) -> dict:
    """Medians of calls taken in turn (plain, torch_function, aten, plain, ...): on a shared
    machine a slow spell then costs every variant alike."""
    from mlipdd.distributed import DistributedModel, DomainConfig

    torch.set_num_threads(1)
    batch = _system(n_atoms)
    model = _lj()
    calls = {"plain": lambda: model(batch, compute_stress=True)}
    for dispatch in ("torch_function", "aten"):
        dm = DistributedModel(model, DomainConfig(cutoff=8.5, skin=0.0, strategy="halo", dispatch=dispatch))
        owned = dm.partition(batch.clone())
        calls[dispatch] = lambda dm=dm, owned=owned: dm(owned, compute_stress=True)
    times = {name: [] for name in calls}
    for _ in range(2):
        for call in calls.values():
            call()
    for _ in range(repeats):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def rank_timing(rank, world_size, n_atoms, repeats):
    import torch.distributed as dist
    from mlipdd.distributed import DistributedModel, DomainConfig

    out = {}
    for dispatch in ("torch_function", "aten"):
        dm = DistributedModel(_lj(), DomainConfig(cutoff=8.5, skin=0.0, strategy="halo", dispatch=dispatch))
        owned = dm.partition(_system(n_atoms) if rank == 0 else None)
        out[dispatch] = _median_ms(lambda dm=dm, owned=owned: dm(owned, compute_stress=True), repeats, dist.barrier)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--atoms", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    from mlipdd.testing import run_ranks

    n = round(args.atoms ** (1 / 3)) ** 3
    one = one_process(args.atoms, args.repeats)
    two = run_ranks(rank_timing, 2, args.atoms, args.repeats, timeout=900)[0]
    info = machine()
    rows = [
        {"ranks": 1, "dispatch": "plain model", "ms": one["plain"]},
        {"ranks": 1, "dispatch": "torch_function (plain tensors at one rank)", "ms": one["torch_function"]},
        {"ranks": 1, "dispatch": "aten (ShardTensor active)", "ms": one["aten"]},
        {"ranks": 2, "dispatch": "torch_function", "ms": two["torch_function"]},
        {"ranks": 2, "dispatch": "aten", "ms": two["aten"]},
    ]
    (RESULTS / "dispatch_cost_aten.json").write_text(json.dumps({"atoms": n, "machine": info, "rows": rows}, indent=1))
    lines = [f"# Aten vs torch-function dispatch: LJ force + stress call, {n} atoms, float64, CPU, 1 thread per rank", "",
             "| ranks | dispatch | ms per call | vs torch_function at the same rank count |",
             "|---|---|---|---|"]
    for r in rows:
        base = one["torch_function"] if r["ranks"] == 1 else two["torch_function"]
        lines.append(f"| {r['ranks']} | {r['dispatch']} | {r['ms']:.1f} | {r['ms'] / base:.2f}x |")
    lines += ["", (f"Machine: {info}. `python benchmarks/dispatch_cost_aten.py --atoms {args.atoms} --repeats "
                   f"{args.repeats}`; medians; a shared machine, so the ratios matter, not the times. The plain "
                   "model builds its neighbour list on every call; the DistributedModel rows reuse theirs.")]
    (RESULTS / "dispatch_cost_aten.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
