"""AIMNet2 at one process: `AIMNet2Wrapper` next to aimnet's own `AIMNet2Calculator`, CPU or GPU.

    python benchmarks/aimnet2_vs_calculator.py [--sizes 300,1000,3000,10000] [--kinds molecule,...]
    python benchmarks/aimnet2_vs_calculator.py --profile 1000     # torch.profiler: where one call goes
    python benchmarks/aimnet2_vs_calculator.py --device cuda --repeats 5 --name aimnet2_vs_calculator_gpu --out $OUT

The systems and both codes come from `aimnet2_cases` (the same exported random weights,
float32, energy + forces per call): one open molecule (DSF), a batch of 48-atom molecules
(all-pairs Coulomb), a triclinic molecular crystal (DSF) and the same crystal with Ewald.
Three timings per case:

* ``aimnet_s``: ``calc(data, forces=True)``, which builds its neighbour matrices every call;
* ``mlipdd_call_s``: ``model(batch)`` on a batch without a list (the wrapper builds one,
  as the calculator does);
* ``mlipdd_step_s``: ``model(batch)`` with the list attached, as in dynamics, where a
  list built with a skin serves several steps.

Times are the process's CPU seconds (``time.process_time``, one intra-op thread): on a
machine shared with other jobs wall time swings 2x with their load, CPU time less. The
calls alternate (aimnet, mlipdd, aimnet, ...) after a warm-up and each timing is the best
of ``--repeats``. ``--profile`` lists the top operators (self CPU time) of one call of each.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import torch
from _common import markdown_table, write_results
from aimnet2_cases import KINDS, agreement, both_codes, exported_model, systems


def _setup(kind, size, path, device="cpu"):
    from mlipdd.neighbors import attach_neighbors

    batch, data = systems(kind, size)
    batch = batch.to(device=device)
    data = {k: v.to(device) for k, v in data.items()}
    wrapper, calcs = both_codes(kind, batch, path, device)
    listed = batch.clone()
    attach_neighbors(listed, wrapper.cutoff)
    calc = calcs["aimnet s"]
    calls = {"aimnet_s": lambda: calc(dict(data), forces=True), "mlipdd_call_s": lambda: wrapper(batch),
             "mlipdd_step_s": lambda: wrapper(listed)}
    return batch, calls


def _timings(calls: dict, repeats: int, device="cpu") -> tuple[dict, dict]:
    """(best, median) of ``repeats`` alternating calls: CPU seconds on the CPU, synchronised wall
    seconds on a GPU (where the host's time is the call's time only with the device done)."""
    cuda = device.startswith("cuda")
    clock = time.perf_counter if cuda else time.process_time
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            if cuda:
                torch.cuda.synchronize()
            start = clock()
            call()
            if cuda:
                torch.cuda.synchronize()
            times[name].append(clock() - start)
    return ({name: min(t) for name, t in times.items()},
            {name: sorted(t)[len(t) // 2] for name, t in times.items()})


def compare(kind, size, path, repeats, device="cpu") -> dict:
    batch, calls = _setup(kind, size, path, device)
    ours, theirs = calls["mlipdd_call_s"](), calls["aimnet_s"]()  # warm-up and the agreement check
    calls["mlipdd_step_s"]()
    best, median = _timings(calls, repeats, device)
    return {"kind": kind, "atoms": batch.num_atoms, "systems": batch.num_systems, **best,
            "aimnet_over_mlipdd_call": best["aimnet_s"] / best["mlipdd_call_s"],
            "aimnet_over_mlipdd_step": best["aimnet_s"] / best["mlipdd_step_s"],
            "median_aimnet_over_mlipdd_call": median["aimnet_s"] / median["mlipdd_call_s"],
            "median_aimnet_over_mlipdd_step": median["aimnet_s"] / median["mlipdd_step_s"], **agreement(ours, theirs)}


# runtime calls that make the host wait for the device (or launch work), counted per call on a GPU
_RUNTIME_CALLS = ("cudaLaunchKernel", "cudaStreamSynchronize", "cudaMemcpyAsync", "cudaDeviceSynchronize",
                  "cudaEventSynchronize")


def profile(kind, size, path, top, device="cpu") -> list[dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _, calls = _setup(kind, size, path, device)
    rows = []
    for code, call in calls.items():
        call()
        with torch_profile(activities=activities) as prof:
            call()
            if cuda:
                torch.cuda.synchronize()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events) / 1e6
        name = code.removesuffix("_s")
        rows.append({"kind": kind, "code": name, "op": "(all)", "self_s": total, "share": 1.0, "calls": None})
        rows += [{"kind": kind, "code": name, "op": e.key[:60], "self_s": e.self_cpu_time_total / 1e6,
                  "share": e.self_cpu_time_total / 1e6 / total, "calls": e.count} for e in events[:top]]
        if cuda:
            rows += [{"kind": kind, "code": name, "op": e.key, "self_s": e.self_cpu_time_total / 1e6,
                      "share": e.self_cpu_time_total / 1e6 / total, "calls": e.count}
                     for e in events if e.key in _RUNTIME_CALLS]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="300,1000,3000,10000")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", type=int, default=None, help="one size: the top operators instead")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--label", default="", help="added to the notes (e.g. the commit measured)")
    p.add_argument("--name", default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda (synchronised wall time there)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="results folder (default benchmarks/results)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    start = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = exported_model(pathlib.Path(tmp))
        for size in ([args.profile] if args.profile else [int(s) for s in args.sizes.split(",")]):
            for kind in args.kinds.split(","):
                if args.profile:
                    rows += profile(kind, size, path, args.top, args.device)
                else:
                    rows.append(compare(kind, size, path, args.repeats, args.device))
                    print(json.dumps(rows[-1]), flush=True)  # rows as they come (a long run may be cut)
    notes = (f"{args.label} Random-weight AIMNet2 (released architecture, released-scale atomic shifts), float32, "
             f"energy + forces, {args.threads} intra-op thread(s), one process (`benchmarks/aimnet2_cases.py` for "
             f"the systems). Load average at start {load:.1f}, at the end {os.getloadavg()[0]:.1f}, on "
             f"{os.cpu_count()} cores (a machine shared with other jobs); {time.time() - start:.0f} s in all.")
    if args.profile:
        columns = ["kind", "code", "op", "self_s", "share", "calls"]
        title = (f"AIMNet2 one call at ~{args.profile} atoms on {args.device}: top operators by self CPU time "
                 "(torch.profiler; on a GPU also the runtime's launches, copies and syncs)")
        notes += " One profiled call each after a warm-up; self time of an operator, its share of the call's total."
    else:
        columns = ["kind", "atoms", "systems", "aimnet_s", "mlipdd_call_s", "mlipdd_step_s", "aimnet_over_mlipdd_call",
                   "aimnet_over_mlipdd_step", "median_aimnet_over_mlipdd_call", "median_aimnet_over_mlipdd_step",
                   "energy diff eV", "force diff max", "force diff rel", "charge diff max"]
        title = f"AIMNet2 at one process: mlipdd vs aimnet's calculator ({args.device})"
        clock = "synchronised wall seconds" if args.device.startswith("cuda") else "CPU seconds of the process"
        notes += (f" {clock}, best of {args.repeats} alternating calls after a warm-up (the median_ columns: "
                  "the ratio of the medians).")
    if args.name is None:
        print(markdown_table(rows, columns))
        return 0
    print(write_results(args.name, title, rows, columns, notes, *([args.out] if args.out else [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
