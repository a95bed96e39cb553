"""Small MACE systems on one GPU: where mlipdd's 1-rank time goes (goal: <= 1.03x bare).

    python benchmarks/mace_small.py --sizes 1000,4096 --repeats 30 [--profile]

Four ways to get energy + forces of the same medium MACE and system, interleaved:
``bare`` (raw mace on a prebuilt input dict), ``wrapper`` (`MACEWrapper` on the batch:
builds mace's input each call), ``dm check_every=1`` (`DistributedModel` at one rank,
validity and NaN checks read on the host every call) and ``dm`` (the default: checks
accumulated on the device, read every 10 calls). With ``--profile`` it also prints the
host-side profile of one dm call (top ops by self CPU time, device synchronisations).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch
from _common import median_time, write_results
from memory_wall import medium_model, si
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.neighbors import attach_neighbors
from mlipdd_mace import MACEWrapper


def measure(n, repeats, profile):
    raw = medium_model("cuda")
    wrapper = MACEWrapper(raw)
    batch = si(n, "cuda")
    attach_neighbors(batch, wrapper.cutoff)
    data = wrapper.adapt_input(batch)

    def bare():
        data["positions"].requires_grad_(True)
        raw(data, training=False, compute_force=True)

    runs = {"bare": bare, "wrapper": lambda: wrapper(batch)}
    for every in (1, 10):
        dm = DistributedModel(wrapper, DomainConfig(cutoff=wrapper.cutoff, skin=0.0, check_every=every))
        owned = dm.partition(batch)
        runs[f"dm check_every={every}"] = (lambda dm=dm, owned=owned: dm(owned))
    times = {k: [] for k in runs}
    for _ in range(repeats):  # interleaved, so drift hits every mode alike
        for name, fn in runs.items():
            times[name].append(median_time(fn, 3, warmup=1, sync=torch.cuda.synchronize))
    bare_ms = statistics.median(times["bare"]) * 1e3
    rows = []
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        rows.append({"atoms": batch.num_atoms, "mode": name, "ms": ms, "ratio": ms / bare_ms})
    if profile:
        _profile(runs["dm check_every=1"], f"dm check_every=1, {batch.num_atoms} atoms")
        _profile(runs["bare"], f"bare, {batch.num_atoms} atoms")
    return rows


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
    args = p.parse_args(argv)
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        rows += measure(n, args.repeats, args.profile)
        print(rows[-4:], flush=True)
    table = write_results("mace_small_gpu", "Medium MACE, small systems, one GPU: mlipdd 1 rank vs bare mace",
                          rows, ["atoms", "mode", "ms", "ratio"],
                          notes=f"{args.machine}\n\nmedian of {args.repeats} interleaved rounds (each the median of 3 "
                                "calls); float32, diamond Si, random weights; ratio = ms / bare ms.")
    print(table)


if __name__ == "__main__":
    main()
