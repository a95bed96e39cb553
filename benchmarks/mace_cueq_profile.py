"""Where a cuEq MACE force call spends its time: torch.profiler summary of one call.

    python benchmarks/mace_cueq_profile.py --atoms 64000 --kinds bare,mlipdd
    python benchmarks/mace_cueq_profile.py --atoms 131072 --kinds chunked --chunk-atoms 16384

Kinds: ``bare`` (mace's cuEq model on its own input dict), ``mlipdd``
(`DistributedModel(MACEWrapper(model))` at one rank: input building, Verlet-list trimming,
checks) and ``chunked`` (the same with ``chunk_atoms``: `FusedEdgeChunkedMessages`). Each kind:
two warm-up calls, then one profiled call (CPU + CUDA activities) and one with Python stacks,
whose host syncs (``cudaStreamSynchronize``, ``aten::_local_scalar_dense``, ``aten::nonzero``,
device-to-host copies) are traced to the nearest mlipdd / mace / cuequivariance frame. Writes
``<name>_<kind>_<atoms>.{md,json}``: totals (wall ms, kernel ms, sync count and time), the top
ops by self device time and by self host time, and the sync sources. Float32 diamond Si, random
weights (128x0e+128x1o, max_ell 3, correlation 3, 6 A, 2 layers); ``--device cpu`` is a smoke
run (e3nn model, CPU activities only).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch
from _common import RESULTS, machine, markdown_table
from memory_wall import medium_model, si
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.neighbors import attach_neighbors
from mlipdd_mace import MACEWrapper
from torch.profiler import ProfilerActivity, profile

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
            "aten::_local_scalar_dense", "aten::nonzero", "cudaMemcpy")
OUR_FRAMES = ("mlipdd", "mace", "cuequivariance", "vesin")


def build(kind, n, chunk, device):
    model = medium_model(device)
    if device == "cuda":
        from mace.cli.convert_e3nn_cueq import run as to_cueq

        model = to_cueq(model, device="cuda").to("cuda").eval()
    if kind == "bare":
        wrapper = MACEWrapper(model)
        batch = si(n, device)
        attach_neighbors(batch, wrapper.cutoff)
        data = wrapper.adapt_input(batch)

        def call():
            data["positions"].requires_grad_(True)
            return model(data, training=False, compute_force=True)["forces"]
        return call
    wrapper = MACEWrapper(model, chunk_atoms=chunk if kind == "chunked" else None)
    dm = DistributedModel(wrapper, DomainConfig(cutoff=wrapper.cutoff, skin=0.5))
    owned = dm.partition(si(n, device))
    return lambda: dm(owned)["forces"]


def _self_device_us(event):
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _source(event):
    """The innermost stack frame in mlipdd / mace / cuequivariance / vesin code."""
    for frame in event.stack or []:
        if any(f"/{name}" in frame or frame.startswith(name) for name in OUR_FRAMES):
            return frame
    return (event.stack or ["(no Python frame)"])[0]


def profile_kind(kind, n, chunk, device, top):
    call = build(kind, n, chunk, device)
    for _ in range(2):
        call()
    _sync(device)
    start = time.perf_counter()
    call()
    _sync(device)
    unprofiled_ms = 1e3 * (time.perf_counter() - start)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        _sync(device)
    events = prof.key_averages()
    kernel_us = sum(_self_device_us(e) for e in events if e.device_type.name == "CUDA")
    syncs = [e for e in events if e.key.startswith(SYNC_OPS)]
    rows_device = sorted(events, key=_self_device_us, reverse=True)[:top]
    rows_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]

    def row(e):
        return {"op": e.key[:70], "calls": e.count, "self_host_ms": e.self_cpu_time_total / 1e3,
                "self_device_ms": _self_device_us(e) / 1e3, "host_total_ms": e.cpu_time_total / 1e3}

    with profile(activities=activities, with_stack=True) as stacked:
        call()
        _sync(device)
    sources = collections.defaultdict(lambda: {"calls": 0, "host_ms": 0.0})
    for e in stacked.events():
        if e.name.startswith(SYNC_OPS):
            entry = sources[(e.name, _source(e))]
            entry["calls"] += 1
            entry["host_ms"] += e.cpu_time_total / 1e3
    source_rows = sorted(({"op": op, "where": where[:110], **v} for (op, where), v in sources.items()),
                         key=lambda r: -r["host_ms"])[:top]
    summary = {"kind": kind, "atoms": n, "chunk_atoms": chunk if kind == "chunked" else None,
               "wall_ms_unprofiled": unprofiled_ms, "kernel_ms": kernel_us / 1e3,
               "sync_calls": sum(e.count for e in syncs), "sync_host_ms": sum(e.cpu_time_total for e in syncs) / 1e3,
               "peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}
    return summary, [row(e) for e in rows_device], [row(e) for e in rows_host], source_rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--atoms", type=int, default=64000)
    p.add_argument("--kinds", default="bare,mlipdd")
    p.add_argument("--chunk-atoms", type=int, default=16384)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda")
    p.add_argument("--machine", default="")
    p.add_argument("--name", default="mace_cueq_profile")
    p.add_argument("--out-dir", type=pathlib.Path, default=RESULTS)
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    op_cols = ["op", "calls", "self_device_ms", "self_host_ms", "host_total_ms"]
    for kind in args.kinds.split(","):
        summary, by_device, by_host, sources = profile_kind(kind, args.atoms, args.chunk_atoms, args.device, args.top)
        print(json.dumps(summary), flush=True)
        text = (f"# cuEq MACE {kind} call at {args.atoms} atoms: torch.profiler summary\n\n{args.machine}\n\n"
                f"Machine: {json.dumps(machine())}\n\n{markdown_table([summary], list(summary))}\n"
                f"## Top ops by self device time\n\n{markdown_table(by_device, op_cols)}\n"
                f"## Top ops by self host time\n\n{markdown_table(by_host, op_cols)}\n"
                f"## Host syncs by source (profiled with stacks)\n\n"
                f"{markdown_table(sources, ['op', 'where', 'calls', 'host_ms'])}\n"
                f"{__doc__.split(chr(10) + chr(10), 2)[2]}")
        print(text, flush=True)
        stem = args.out_dir / f"{args.name}_{kind}_{args.atoms}"
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps({"machine": machine(), "summary": summary, "by_device": by_device,
                                                         "by_host": by_host, "sync_sources": sources}, indent=1))
        del by_device, by_host
        if args.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
