"""Eager cost of the aten-level dispatch vs the bare model, per force call (CPU).

    python benchmarks/dispatch_cost_aten.py [--atoms 1000] [--repeats 7] [--models lj,mace] [--ranks 2]

Per model, forces + stress, one thread per rank:

* ``lj``: LJ argon, cutoff 8.5 A, float64, ~1000 atoms;
* ``mace``: medium MACE (random weights, `mace_medium_config`: 128x0e+128x1o, 2
  interactions, r_max 5 A), float32 as the MACE overhead runners, diamond Si, ~1000 atoms.

Rows at one rank: the model alone (``plain``; LJ builds its list every call, MACE
gets one attached), ``aten`` (the model gets plain tensors at one rank: NOTE [aten at
one rank]) and ``aten rows`` (the aten
ShardTensors kept at one rank, ``rows_at_one_rank``: what every op's rule costs). Taken
in turn, call by call, so a slow spell of the shared machine costs every variant alike.
``--ranks 2``: spawned gloo ranks, rank 0's median (LJ only by
default: MACE at 2 ranks is minutes on this machine; ``--rank-models`` adds it).

``--device cuda``: the same on one GPU (the ranks share it over gloo), each call synchronised.
Rows go to results/dispatch_cost_aten.json and the table to results/dispatch_cost_aten.md
(``--out`` / ``--name`` elsewhere). Not a timed test: the machine is shared, so read the
ratios, not the absolute times.
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


def _lj_system(n_atoms: int):
    from mlipdd.testing.systems import cubic

    return cubic(reps=max(2, round(n_atoms ** (1 / 3))))


def _mace():
    from mlipdd_mace import MACEWrapper
    from mlipdd_mace.testing import mace_medium_config, random_mace

    cfg = mace_medium_config()
    return MACEWrapper(random_mace(elements=(14,), r_max=cfg["r_max"], num_interactions=cfg["num_interactions"],
                                   hidden_irreps=cfg["hidden_irreps"], max_ell=cfg["max_ell"],
                                   correlation=cfg["correlation"], dtype=torch.float32, seed=0)).eval()


def _mace_system(n_atoms: int):
    from mlipdd.lattices import silicon_diamond

    batch = silicon_diamond(max(1, round((n_atoms / 8) ** (1 / 3)))).to(dtype=torch.float32)
    g = torch.Generator().manual_seed(0)  # rattled: a perfect crystal's forces are zero
    batch.node["positions"] = batch.positions + 0.05 * torch.randn(batch.positions.shape, generator=g)
    return batch


MODELS = {"lj": (_lj, _lj_system, "float64"), "mace": (_mace, _mace_system, "float32")}


def _dm(model, rows: bool = False):
    from mlipdd.distributed import DistributedModel, DomainConfig

    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.0, strategy="halo"))
    dm.strategy.rows_at_one_rank = rows
    return dm


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_process(name: str, n_atoms: int, repeats: int, device: str = "cpu") -> dict:
    from mlipdd.neighbors import attach_neighbors

    torch.set_num_threads(1)
    make_model, make_system, _ = MODELS[name]
    batch, model = make_system(n_atoms).to(device), make_model().to(device)
    plain = batch.clone()
    if name != "lj":  # the bare model on a prebuilt list (LJ's forward builds its own)
        attach_neighbors(plain, model.cutoff)
    calls = {"plain": lambda: model(plain, compute_stress=True)}
    for label, rows in (("aten", False), ("aten rows", True)):
        dm = _dm(model, rows)
        owned = dm.partition(batch.clone())
        calls[label] = lambda dm=dm, owned=owned: dm(owned, compute_stress=True)
    times = {label: [] for label in calls}
    for call in calls.values():  # warm-up (and the first call's rebuild)
        call()
    for _ in range(repeats):
        for label, call in calls.items():
            _sync(device)
            t = time.perf_counter()
            call()
            _sync(device)
            times[label].append(time.perf_counter() - t)
    return {label: 1e3 * statistics.median(ts) for label, ts in times.items()}


def rank_timing(rank, world_size, name, n_atoms, repeats, device="cpu"):
    import torch.distributed as dist

    torch.set_num_threads(1)
    make_model, make_system, _ = MODELS[name]

    def sync():
        _sync(device)
        dist.barrier()

    dm = _dm(make_model().to(device))
    owned = dm.partition(make_system(n_atoms).to(device) if rank == 0 else None)
    return {"aten": 1e3 * median_time(lambda: dm(owned, compute_stress=True), repeats, warmup=2, sync=sync)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--atoms", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--models", default="lj,mace")
    p.add_argument("--ranks", type=int, default=2, help="several-rank rows at this count (0: none)")
    p.add_argument("--rank-models", default="lj")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the ranks share one GPU over gloo)")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    p.add_argument("--name", default="dispatch_cost_aten")
    args = p.parse_args(argv)
    from mlipdd.testing import run_ranks

    rows = []
    for name in args.models.split(","):
        atoms = MODELS[name][1](args.atoms).num_atoms
        one = one_process(name, args.atoms, args.repeats, args.device)
        for label, ms in one.items():
            rows.append({"model": name, "atoms": atoms, "ranks": 1, "dispatch": label, "ms": ms,
                         "ratio": ms / one["plain"]})
        if args.ranks > 1 and name in args.rank_models.split(","):
            several = run_ranks(rank_timing, args.ranks, name, args.atoms, args.repeats, args.device,
                                timeout=1800)[0]
            for label, ms in several.items():
                rows.append({"model": name, "atoms": atoms, "ranks": args.ranks, "dispatch": label, "ms": ms,
                             "ratio": ms / one["plain"]})
    info = machine()
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    where = "CPU, 1 thread per rank" if args.device == "cpu" else f"{args.device}, 1 host thread per rank"
    lines = [f"# Aten dispatch vs the bare model: force + stress call, {where}", "",
             "| model | atoms | dtype | ranks | dispatch | ms per call | vs plain (one process) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['atoms']} | {MODELS[r['model']][2]} | {r['ranks']} | {r['dispatch']} | "
                     f"{r['ms']:.1f} | {r['ratio']:.3f}x |")
    lines += ["", (f"Machine: {info}. `python benchmarks/dispatch_cost_aten.py {' '.join(argv or sys.argv[1:])}`; "
                   "medians of calls taken in turn; a shared machine, so the ratios matter, not the times. "
                   "`aten` at one rank hands the model plain tensors (NOTE [aten at one rank]); `aten rows` keeps "
                   "the ShardTensors (`rows_at_one_rank`): the cost of the rules themselves. `plain`: LJ builds "
                   "its neighbour list on every call; MACE gets one attached; the DistributedModel rows reuse theirs.")]
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
