"""What the ShardTensor dispatch costs per force call: MACE at 1 and 2 ranks.

    python benchmarks/dispatch_cost.py --label placements [--device cpu|cuda] [--sizes 1000]

At one rank the model gets plain tensors (NOTE [one rank] in mlipdd.strategy.halo), so
the dispatch costs nothing there; at 2 ranks every op on a ShardTensor goes through
its ``__torch_dispatch__`` rules. Run it once per version of the code (``--label``) on the same
machine; rows are appended to ``results/dispatch_cost.json`` and the table rewritten.
On ``--device cuda`` both ranks share one GPU over gloo (what one GPU can show: host cost).
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
from _common import RESULTS, machine


def _model(medium: bool, dtype):
    from mlipdd_mace.testing import random_mace

    if medium:
        return random_mace(elements=(14,), r_max=6.0, num_interactions=2, hidden_irreps="128x0e+128x1o",
                           max_ell=3, correlation=3, dtype=dtype, seed=0)
    return random_mace(elements=(14,), r_max=5.0, channels=32, max_ell=2, correlation=2, dtype=dtype, seed=0)


def rank_timing(rank, world_size, n_atoms, medium, device, strategy, repeats):
    import torch.distributed as dist
    from mlipdd.distributed import DistributedModel, DomainConfig
    from mlipdd.lattices import silicon_diamond
    from mlipdd_mace import MACEWrapper

    dtype = torch.float32
    wrapper = MACEWrapper(_model(medium, dtype)).to(device).eval()
    dm = DistributedModel(wrapper, DomainConfig(cutoff=wrapper.cutoff, skin=0.0, strategy=strategy))
    reps = max(1, round((n_atoms / 8) ** (1 / 3)))
    full = silicon_diamond(reps).to(device=device, dtype=dtype) if rank == 0 else None
    owned = dm.partition(full)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        dm(owned)
    times = []
    for _ in range(repeats):
        sync()
        dist.barrier()
        t = time.perf_counter()
        dm(owned)
        sync()
        dist.barrier()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", required=True, help="which version of the code this is")
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", default="1000")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--medium", action="store_true")
    p.add_argument("--strategies", default="halo,sharded")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    from mlipdd.testing import run_ranks

    path = RESULTS / "dispatch_cost.json"
    data = json.loads(path.read_text()) if path.exists() else {"rows": []}
    for n in (int(s) for s in args.sizes.split(",")):
        for strategy in args.strategies.split(","):
            for w in (int(r) for r in args.ranks.split(",")):
                if w == 1 and strategy != args.strategies.split(",")[0]:
                    continue  # one rank: the strategy plays no part
                ms = 1e3 * max(run_ranks(rank_timing, w, n, args.medium, args.device, strategy, args.repeats,
                                         timeout=1800))
                row = {"label": args.label, "atoms": n, "model": "medium" if args.medium else "small",
                       "device": args.device, "ranks": w, "strategy": strategy if w > 1 else "-",
                       "ms_per_call": round(ms, 2), "machine": machine()}
                print(row, flush=True)
                data["rows"].append(row)
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    lines = ["# MACE force call, per rank count and version of the dispatch (float32, random weights)", "",
             "| label | model | device | atoms | ranks | strategy | ms per call | machine |", "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        m = r["machine"]
        where = f"{m.get('gpu', m['cpu'])}, torch {m['torch']}, {m['date']}"
        lines.append(f"| {r['label']} | {r['model']} | {r['device']} | {r['atoms']} | {r['ranks']} | {r['strategy']} "
                     f"| {r['ms_per_call']} | {where} |")
    (RESULTS / "dispatch_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
