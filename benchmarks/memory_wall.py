"""The single-GPU memory wall of medium MACE: bare mace-torch vs chunked MACE under mlipdd.

    python benchmarks/memory_wall.py --bare 27000,32768,39304 --chunked 32768,110592,216000 \
        --chunk-atoms 2048 --machine "nvidia-h200 ..."

"bare" is the raw mace model on its own input dict (the plain model, as mace's
calculator runs it); "chunked" is `DistributedModel(MACEWrapper(model, chunk_atoms=...))`
at one rank, the setting a user turns on for systems beyond the wall. Before each
chunked run the wrapper's memory estimate is printed; the table puts it next to the
measured peak. Sizes are diamond-silicon supercells (8 n^3 atoms), random weights,
float32. Stops a mode at its first out-of-memory size. Writes
``benchmarks/results/mace_memory_wall.{md,json}``.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch
from _common import median_time, write_results
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.lattices import silicon_diamond
from mlipdd.neighbors import attach_neighbors
from mlipdd_mace import MACEWrapper
from mlipdd_mace.testing import mace_medium_config, random_mace


def medium_model(device):
    cfg = mace_medium_config()
    return random_mace(elements=(14,), r_max=cfg["r_max"], num_interactions=cfg["num_interactions"],
                       hidden_irreps=cfg["hidden_irreps"], max_ell=cfg["max_ell"],
                       correlation=cfg["correlation"], dtype=torch.float32, seed=0).to(device).eval()


def si(n_atoms, device):
    reps = max(1, round((n_atoms / 8) ** (1 / 3)))
    return silicon_diamond(reps).to(device=device, dtype=torch.float32)


def _release():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak():
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def bare_row(n, repeats, device):
    raw = medium_model(device)
    wrapper = MACEWrapper(raw)
    batch = si(n, device)
    attach_neighbors(batch, wrapper.cutoff)
    data = wrapper.adapt_input(batch)
    row = {"mode": "bare mace", "atoms": batch.num_atoms, "edges": int(data["edge_index"].shape[1])}

    def step():
        data["positions"].requires_grad_(True)
        raw(data, training=False, compute_force=True)

    _release()
    try:
        row["step_s"] = median_time(step, repeats, sync=_sync)
        row["peak_GiB"] = _peak()
    except torch.OutOfMemoryError:
        row["status"] = "out of memory"
    return row


def chunked_row(n, chunk_atoms, repeats, device):
    wrapper = MACEWrapper(medium_model(device), chunk_atoms=chunk_atoms)
    batch = si(n, device)
    dm = DistributedModel(wrapper, DomainConfig(cutoff=wrapper.cutoff, skin=0.0))
    owned = dm.partition(batch)
    row = {"mode": f"mlipdd chunked ({chunk_atoms})", "atoms": batch.num_atoms}
    _release()
    try:
        dm.prepare(owned)  # the decomposition stage: the neighbour list, to size the estimate
        n_edges = dm.strategy.state.neighbors.num_edges
        estimate = wrapper.memory_estimate(owned.num_atoms, n_edges)
        print(estimate["summary"], flush=True)
        row.update(edges=n_edges, estimate_GiB=estimate["bytes"] / 2**30,
                   plain_estimate_GiB=estimate["plain_bytes"] / 2**30)
        row["step_s"] = median_time(lambda: dm(owned), repeats, sync=_sync)
        row["peak_GiB"] = _peak()
    except torch.OutOfMemoryError:
        row["status"] = "out of memory"
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bare", default="27000,32768,39304")
    p.add_argument("--chunked", default="32768,110592,216000")
    p.add_argument("--chunk-atoms", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--machine", default="")
    p.add_argument("--device", default="cuda")
    p.add_argument("--name", default="mace_memory_wall")
    args = p.parse_args(argv)
    device = args.device
    rows = []
    for mode, sizes in (("bare", args.bare), ("chunked", args.chunked)):
        for n in (int(s) for s in sizes.split(",") if s):
            row = bare_row(n, args.repeats, device) if mode == "bare" else \
                chunked_row(n, args.chunk_atoms, args.repeats, device)
            row.setdefault("status", "ok")
            if row.get("step_s"):
                row["us_per_atom"] = row["step_s"] / row["atoms"] * 1e6
            print(row, flush=True)
            rows.append(row)
            _release()
            if row["status"] != "ok":
                break
    fits = [r for r in rows if r["mode"] == "bare mace" and r["status"] == "ok"]
    if fits:
        ref = max(fits, key=lambda r: r["atoms"])
        for r in rows:
            if r.get("us_per_atom"):
                r["vs_largest_bare"] = r["us_per_atom"] / ref["us_per_atom"]
    notes = (f"{args.machine}\n\nOne energy + forces call of medium MACE (128x0e+128x1o, max_ell 3, "
             "correlation 3, 6 A, 2 layers), float32, diamond Si, random weights. vs_largest_bare: time "
             "per atom over that of the largest system bare mace-torch fits (target <= 1.5).")
    table = write_results(args.name, "Medium MACE beyond the one-GPU memory wall", rows,
                          ["mode", "atoms", "edges", "step_s", "us_per_atom", "vs_largest_bare", "peak_GiB",
                           "estimate_GiB", "plain_estimate_GiB", "status"], notes=notes)
    print(table)


if __name__ == "__main__":
    main()
