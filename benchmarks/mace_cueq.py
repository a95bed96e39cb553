"""Medium MACE on the cuEquivariance path: mlipdd's one-rank overhead and chunking beyond the wall.

    python benchmarks/mace_cueq.py overhead --sizes 4096,27000,64000 --machine "one H200"
    python benchmarks/mace_cueq.py chunked --sizes 64000,1000000 --chunks 16384,32768 --reference-atoms 64000

``overhead``: one energy + forces call of the bare cuEq model (mace's own
`convert_e3nn_cueq`) on its input dict, against `DistributedModel(MACEWrapper(model))` at
one rank (input building, Verlet-list trimming and checks included). Where both fit on the GPU
at once (``--interleave-below`` atoms) the two calls alternate call by call, ``--repeats`` each,
three times over (medians; the smallest of the three counts, and each run's overhead is listed);
above it, blocks A/B/A/B, so that drift of the GPU clock falls on both.
``chunked``: `MACEWrapper(model, chunk_atoms=...)` under `DistributedModel`, each size and
chunk in its own process (an out-of-memory stops only that row), with the wrapper's memory
estimate next to the measured peak, and the time per atom over bare cuEq's at
``--reference-atoms`` (issue target: <= 1.5 at 1M atoms). Float32, diamond Si, random
weights (128x0e+128x1o, max_ell 3, correlation 3, 6 A, 2 layers). Writes
``benchmarks/results/mace_cueq_{overhead,chunked}.{md,json}`` (``--out-dir`` elsewhere).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch
from _common import RESULTS, median_time, write_results
from memory_wall import medium_model, si
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.neighbors import attach_neighbors
from mlipdd_mace import MACEWrapper


def cueq_model():
    from mace.cli.convert_e3nn_cueq import run as to_cueq

    return to_cueq(medium_model("cuda"), device="cuda").to("cuda").eval()


def _free():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def bare_call(raw, n):
    wrapper = MACEWrapper(raw)
    batch = si(n, "cuda")
    attach_neighbors(batch, wrapper.cutoff)
    data = wrapper.adapt_input(batch)

    def call():
        data["positions"].requires_grad_(True)
        return raw(data, training=False, compute_force=True)["forces"]
    return call


def dm_call(raw, n, chunk=None):
    wrapper = MACEWrapper(raw, chunk_atoms=chunk)
    dm = DistributedModel(wrapper, DomainConfig(cutoff=wrapper.cutoff, skin=0.5))
    owned = dm.partition(si(n, "cuda"))
    return lambda: dm(owned)["forces"]


def ms(call, repeats):
    return 1e3 * median_time(call, repeats=repeats, warmup=2, sync=torch.cuda.synchronize)


def interleaved_ms(calls: dict, repeats: int) -> dict:
    """Median ms of each call, the calls taken in turn (A, B, A, B, ...) so that drift of the GPU
    clock and of the host's load falls on all of them alike."""
    for call in calls.values():
        call(), call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def overhead(args):
    raw = cueq_model()
    rows = []
    for n in args.sizes:
        if n <= args.interleave_below:  # both fit at once: call by call
            _free()
            runs = [interleaved_ms({"bare": bare_call(raw, n), "dm": dm_call(raw, n)}, args.repeats)
                    for _ in range(3)]
            times = {name: [r[name] for r in runs] for name in ("bare", "dm")}
            how = f"interleaved, 3 x {args.repeats}"
        else:  # one at a time (64k: the bare model alone takes 112 GiB): blocks A/B/A/B
            times = {"bare": [], "dm": []}
            for name in ("bare", "dm", "bare", "dm"):
                _free()
                call = bare_call(raw, n) if name == "bare" else dm_call(raw, n)
                times[name].append(ms(call, 12 if n < 50_000 else 6))
                del call
            how = "blocks A/B/A/B"
        bare, dm = min(times["bare"]), min(times["dm"])
        ratios = [d / b - 1 for b, d in zip(times["bare"], times["dm"])]
        rows.append({"atoms": n, "bare_ms": bare, "mlipdd_ms": dm, "overhead_pct": 100 * (dm / bare - 1),
                     "overhead_pct_per_run": [round(100 * r, 2) for r in ratios], "how": how,
                     "bare_runs": [round(t, 2) for t in times["bare"]], "mlipdd_runs": [round(t, 2) for t in times["dm"]]})
        print(rows[-1], flush=True)
    table = write_results(f"{args.name}_overhead", "cuEq MACE: mlipdd at one rank against the bare model", rows,
                          ["atoms", "bare_ms", "mlipdd_ms", "overhead_pct", "overhead_pct_per_run", "how",
                           "bare_runs", "mlipdd_runs"],
                          notes=f"{args.machine}\n\n{__doc__.split('``overhead``')[1].split('``chunked``')[0].strip()}",
                          out_dir=args.out_dir)
    print(table)


def one_chunked(n, chunk):
    """One row, in this process: time, peak and estimate of a chunked call."""
    raw = cueq_model()
    _free()
    call = dm_call(raw, n, chunk)
    t = ms(call, 3)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del call
    batch = si(n, "cuda")
    edges = attach_neighbors(batch, float(raw.r_max)).edge_index.shape[1]
    estimate = MACEWrapper(raw, chunk_atoms=chunk).memory_estimate(n, edges)["bytes"] / 2**30
    return {"atoms": n, "edges": edges, "chunk_atoms": chunk, "step_ms": t, "us_per_atom": 1e3 * t / n,
            "peak_GiB": peak, "estimate_GiB": estimate}


def chunked(args):
    raw = cueq_model()
    _free()
    reference = ms(bare_call(raw, args.reference_atoms), 6) * 1e3 / args.reference_atoms
    del raw
    _free()
    rows = []
    for n in args.sizes:
        for chunk in args.chunks:
            proc = subprocess.run([sys.executable, __file__, "one-chunked", str(n), str(chunk)],
                                  capture_output=True, text=True, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if lines else {
                "atoms": n, "chunk_atoms": chunk,
                "status": "out of memory" if "OutOfMemoryError" in proc.stderr else proc.stderr.strip()[-200:]}
            row.setdefault("status", "ok")
            if "us_per_atom" in row:
                row["vs_bare_per_atom"] = row["us_per_atom"] / reference
            rows.append(row)
            print(row, flush=True)
    notes = (f"{args.machine}\n\nReference: bare cuEq at {args.reference_atoms} atoms, {reference:.3f} us per atom. "
             f"vs_bare_per_atom: time per atom over that reference.")
    print(write_results(f"{args.name}_chunked", "cuEq MACE beyond the memory wall: chunked calls", rows,
                        ["atoms", "edges", "chunk_atoms", "step_ms", "us_per_atom", "vs_bare_per_atom", "peak_GiB",
                         "estimate_GiB", "status"], notes=notes, out_dir=args.out_dir))


def main():
    # a stalled row prints its stack (MLIPDD_BENCH_STALL_S seconds; the device call's limit is short)
    if os.environ.get("MLIPDD_BENCH_STALL_S"):
        faulthandler.dump_traceback_later(int(os.environ["MLIPDD_BENCH_STALL_S"]), exit=True)
    if len(sys.argv) == 4 and sys.argv[1] == "one-chunked":
        print(json.dumps(one_chunked(int(sys.argv[2]), int(sys.argv[3]))), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["overhead", "chunked"])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 27000, 64000])
    p.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[16384, 32768])
    p.add_argument("--reference-atoms", type=int, default=64000)
    p.add_argument("--repeats", type=int, default=40, help="overhead: calls of each per interleaved run")
    p.add_argument("--interleave-below", type=int, default=30_000, help="overhead: sizes run call by call")
    p.add_argument("--machine", default="")
    p.add_argument("--name", default="mace_cueq")
    p.add_argument("--out-dir", type=pathlib.Path, default=RESULTS)
    args = p.parse_args()
    overhead(args) if args.mode == "overhead" else chunked(args)


if __name__ == "__main__":
    main()
