"""Small MACE systems on one GPU: where mlipdd's 1-rank time goes (goal: <= 1.03x bare).

    python benchmarks/mace_small.py --sizes 1000,4096 --repeats 30 [--profile] [--modes ...]

Ways to get energy + forces of the same medium MACE and system, interleaved:
``bare`` (raw mace on a prebuilt input dict), ``bare cuda_graph`` (the same call captured
in a CUDA graph by hand: the floor of launch cost), ``wrapper`` (`MACEWrapper` on the
batch: builds mace's input each call), ``dm check_every=1`` (`DistributedModel` at one
rank, validity and NaN checks read on the host every call), ``dm`` (the default: checks
read every 10 calls), ``dm cuda_graph`` (``DomainConfig(cuda_graph=True)``), and the two
dm modes again with the default Verlet skin of 0.5 A (``skin=0.5``; the others use a
list of exactly r_max). ``captures`` is how often a graphed mode captured in the whole
run (1: never again after the first call), ``first_ms`` its first call (warm-up +
capture). With ``--profile`` it also prints the host-side profile of one dm call and of
one dm cuda_graph call (top ops by self CPU time, device synchronisations).
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch
from _common import median_time, write_results
from memory_wall import medium_model, si
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.distributed.cuda_graph import capture_graph
from mlipdd.neighbors import attach_neighbors
from mlipdd_mace import MACEWrapper

MODES = ("bare", "bare cuda_graph", "wrapper", "dm", "dm cuda_graph", "dm skin=0.5", "dm cuda_graph skin=0.5")


def bare_graphed(raw, data):
    """Raw mace's energy + forces call captured in a CUDA graph by hand (static inputs,
    warm-up on a side stream, capture, replay; outputs cloned as mlipdd's are)."""
    static = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in data.items()}
    static["positions"].requires_grad_(True)

    def call():
        out = raw(static, training=False, compute_force=True)
        return out["energy"], out["forces"]

    graph_replay, (energy, forces) = capture_graph(call, 2, static["positions"].device)

    def replay():
        with torch.no_grad():
            static["positions"].copy_(data["positions"])
        graph_replay()
        return energy.clone(), forces.clone()

    return replay


def measure(n, repeats, profile, modes, device="cuda"):
    raw = medium_model(device)
    wrapper = MACEWrapper(raw)
    batch = si(n, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    attach_neighbors(batch, wrapper.cutoff)
    data = wrapper.adapt_input(batch)

    def bare():
        data["positions"].requires_grad_(True)
        raw(data, training=False, compute_force=True)

    runs, models, first_ms, failed = {}, {}, {}, {}
    for name in modes:
        t0 = time.perf_counter()
        try:
            runs[name] = _make_run(name, raw, wrapper, batch, data, bare, models)
            runs[name]()  # the first call: the partition's rebuild, the capture when graphed
            sync()
        except Exception as error:  # noqa: BLE001 - one failing mode must not cost the others' numbers
            runs.pop(name, None)
            failed[name] = f"{type(error).__name__}: {error}"[:300]
            print(f"mode {name!r} failed: {failed[name]}", flush=True)
            continue
        first_ms[name] = (time.perf_counter() - t0) * 1e3
    times = {k: [] for k in runs}
    for _ in range(repeats):  # interleaved, so drift hits every mode alike
        for name, fn in runs.items():
            times[name].append(median_time(fn, 3, warmup=1, sync=sync))
    base = statistics.median(times["bare"]) * 1e3 if "bare" in times else float("nan")
    rows = []
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        dm = models.get(name)
        rows.append({"atoms": batch.num_atoms, "edges": batch.neighbors.num_edges, "mode": name, "ms": ms,
                     "ratio": ms / base, "captures": dm.cuda_graph_captures if dm is not None else "",
                     "graph_edges": dm._graphed.capacity if dm is not None and dm._graphed is not None else "",
                     "first_ms": first_ms[name]})
    rows += [{"atoms": batch.num_atoms, "mode": name, "ms": "failed", "captures": why} for name, why in failed.items()]
    if profile:
        for name in ("dm", "dm cuda_graph", "bare"):
            if name in runs:
                _profile(runs[name], f"{name}, {batch.num_atoms} atoms")
    return rows


def _make_run(name, raw, wrapper, batch, data, bare, models):
    if name == "bare":
        return bare
    if name == "bare cuda_graph":
        return bare_graphed(raw, data)
    if name == "wrapper":
        return lambda: wrapper(batch)
    every = 1 if "check_every=1" in name else 10
    skin = 0.5 if "skin=0.5" in name else 0.0
    config = DomainConfig(cutoff=wrapper.cutoff, skin=skin, check_every=every, cuda_graph="cuda_graph" in name)
    dm = models[name] = DistributedModel(wrapper, config)
    owned = dm.partition(batch)
    return lambda: dm(owned)


def _profile(fn, label):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(f"--- host profile: {label}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    syncs = {e.key: e.count for e in events if "Synchronize" in e.key or e.key in
             ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal")}
    print("synchronising calls:", syncs, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="1000,4096")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--machine", default="")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}")
    p.add_argument("--name", default="mace_small_gpu", help="results file name (benchmarks/results/NAME.md)")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to check the script (no graph modes)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES) - {"dm check_every=1"})
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {MODES} or 'dm check_every=1'")
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        rows += measure(n, args.repeats, args.profile, modes, args.device)
        gc.collect()  # a DistributedModel and its graph form a cycle: free the size's graphs now
        if args.device == "cuda":
            torch.cuda.empty_cache()
        for row in rows[-len(modes):]:
            print(row, flush=True)
    table = write_results(args.name, "Medium MACE, small systems, one GPU: mlipdd 1 rank vs bare mace",
                          rows, ["atoms", "edges", "mode", "ms", "ratio", "captures", "graph_edges", "first_ms"],
                          notes=f"{args.machine}\n\nmedian of {args.repeats} interleaved rounds (each the median of 3 "
                                "calls); float32, diamond Si, random weights; ratio = ms / bare ms; edges: "
                                "the r_max list; captures: CUDA-graph captures in the whole run; graph_edges: the "
                                "graph's edge slots (edges within the cutoff + 10% null edges); first_ms: "
                                "first call (rebuild, warm-up and capture).")
    print(table)


if __name__ == "__main__":
    main()
