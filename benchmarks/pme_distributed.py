"""PME's reciprocal part with the whole mesh on every rank vs the mesh split over ranks.

``PMEWrapper(mesh="replicated")``: each rank spreads its atoms onto the whole mesh, the
meshes are all-reduced and every rank FFTs all of it. ``mesh="distributed"``: x-slabs,
a distributed FFT (plugins/ewald_pme/mlipdd_ewald_pme/slab_fft.py). Both with the same
plain-torch B-splines (order 6), so they compute the same numbers; ``warp``: the replicated
mesh with nvalchemiops' spline kernels (PMEWrapper's default spreading at this accuracy). Rattled rock salt
(Na+/Cl-, tilted cell), the splitting of an 8 A cutoff at accuracy 1e-4 (the default mesh
from the error estimate), energy + forces (autograd), float64, CPU, one thread per rank;
the real-space part is left out (a 1 A halo) so that the mesh is what is timed.

Per rank: seconds per call (the slowest rank, median of 3 after a warm-up), mesh bytes
(the mesh-shaped tensors of one call: spread buffer, slab, spectrum, Green function,
potential; the replicated mesh: mesh, its FFT, Green function, potential) and peak RSS.

    python benchmarks/pme_distributed.py [--sizes 10000,100000] [--ranks 1,2,3,4] [--modes replicated,distributed]
"""

from __future__ import annotations

import argparse
import math
import resource
import time

import torch
from _common import write_results

ACCURACY, CUTOFF = 1e-4, 8.0


def _system(n_atoms):
    from mlipdd_ewald_pme.testing import rock_salt

    cells = max(1, round((n_atoms / 8) ** (1 / 3)))
    return rock_salt((cells, cells, cells), rattle=0.1, seed=0)


def _run(rank, world_size, batch, mode, mesh_spacing=None):
    from mlipdd.distributed import DistributedModel, DomainConfig
    from mlipdd_ewald_pme import distributed_pme
    from mlipdd_ewald_pme.testing import reciprocal_only

    torch.set_num_threads(1)
    model = reciprocal_only(mode, CUTOFF, ACCURACY, mesh_spacing)  # "warp": replicated, nvalchemiops' splines
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.0))
    owned = dm.partition(batch if rank == 0 else None)
    out = dm(owned)  # builds the halo
    times = []
    for _ in range(3):
        torch.distributed.barrier()
        start = time.perf_counter()
        out = dm(owned)
        times.append(time.perf_counter() - start)
    dims = model.mesh_dimensions(owned.cell)[0]
    if mode == "distributed":
        mesh_bytes = distributed_pme.MESH_BYTES["last"]
    else:  # the whole mesh, its complex FFT, the Green function, the potential
        mesh_bytes = math.prod(dims) * (8 + 16 + 8 + 8)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": sorted(times)[1], "mesh_bytes": mesh_bytes, "rss": rss, "dims": dims,
            "energy": float(out["energy"][0])}


def main():
    from mlipdd.testing import run_ranks

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--ranks", default="1,2,3,4")
    parser.add_argument("--modes", default="replicated,distributed")
    parser.add_argument("--name", default="pme_distributed")
    parser.add_argument("--mesh-spacing", type=float, default=None,
                        help="A; default: the mesh from the error estimate (its search costs minutes at 1M ions)")
    args = parser.parse_args()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        batch = _system(size)
        for ranks in (int(r) for r in args.ranks.split(",")):
            row = {"atoms": batch.num_atoms, "ranks": ranks}
            energies = {}
            for mode in args.modes.split(","):
                parts = run_ranks(_run, ranks, batch, mode, args.mesh_spacing, timeout=3000)
                row["mesh"] = "x".join(map(str, parts[0]["dims"]))
                row[f"{mode} s/call"] = max(p["seconds"] for p in parts)
                row[f"{mode} mesh MB/rank"] = max(p["mesh_bytes"] for p in parts) / 2**20
                row[f"{mode} peak RSS MB/rank"] = max(p["rss"] for p in parts) / 2**20
                energies[mode] = parts[0]["energy"]
            if {"replicated", "distributed"} <= set(energies):
                a, b = energies["distributed"], energies["replicated"]
                row["energy rel. diff"] = abs(a - b) / abs(b)
            rows.append(row)
            print(row, flush=True)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    notes = ("Reciprocal part only (energy + forces by autograd), float64, order-6 B-splines, one thread per "
             "rank; slowest rank, median of 3 calls after a warm-up. Mesh MB: the mesh-shaped tensors of one "
             "call per rank. The machine's 2 cores are shared with other jobs (load ~8): 3 and 4 ranks "
             "oversubscribe them, so their seconds show the work per rank only loosely; the mesh bytes are exact.")
    print(write_results(args.name, "PME reciprocal part: replicated vs distributed mesh (CPU)", rows, columns, notes))


if __name__ == "__main__":
    main()
