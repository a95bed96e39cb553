"""DistributedModel at 1 rank vs the bare model on the same batch (goal: ratio <= 1.05).

    python benchmarks/overhead.py [--atoms 4000] [--repeats 7] [--device cpu|cuda]

Both see a prebuilt neighbour list and time one energy + forces evaluation; the
difference is the decomposition machinery (input agreement, padding, ShardTensor
dispatch, consolidation).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _common import median_time, write_results
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.lattices import fcc_argon
from mlipdd.models.lj import LennardJones
from mlipdd.neighbors import attach_neighbors
from mlipdd.testing.toy_models import ToyMPNN

MODELS = {
    "lj": lambda dtype: LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.5),
    "mpnn": lambda dtype: ToyMPNN(cutoff=5.0, features=32, layers=3, species=(18,), dtype=dtype),
}


def measure(name: str, atoms: int, repeats: int, device: str, dtype) -> dict:
    batch = fcc_argon(n_atoms=atoms).to(device=device, dtype=dtype)
    model = MODELS[name](dtype).to(device=device, dtype=dtype)
    attach_neighbors(batch, model.cutoff)
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.0))
    owned = dm.partition(batch)
    # Interleaved (bare, dd, bare, dd, ...) so that drift of a shared machine hits both alike.
    bare_times, dd_times = [], []
    for _ in range(repeats):
        bare_times.append(median_time(lambda: model(batch), 1, warmup=1, sync=sync))
        dd_times.append(median_time(lambda: dm(owned), 1, warmup=1, sync=sync))
    bare, dist_time = statistics.median(bare_times), statistics.median(dd_times)
    return {"model": name, "atoms": batch.num_atoms, "device": device, "bare_ms": bare * 1e3,
            "dd_1rank_ms": dist_time * 1e3, "ratio": dist_time / bare}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--atoms", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    p.add_argument("--name", default="overhead")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = [measure(m, args.atoms, args.repeats, args.device, dtype) for m in MODELS]
    table = write_results(args.name, "DistributedModel overhead at 1 rank (goal: ratio <= 1.05)", rows,
                          ["model", "atoms", "device", "bare_ms", "dd_1rank_ms", "ratio"])
    print(table)


if __name__ == "__main__":
    main()
