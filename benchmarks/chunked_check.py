"""Chunked MACE vs the plain model on one device: energy, forces, stress, relative max diff.

    python benchmarks/chunked_check.py [--device cuda] [--atoms 4096]

Medium MACE in float32 (diamond Si, rattled) and a small three-element MACE in float64
(triclinic), each at several ``chunk_atoms``; float32 differences are summation-order
noise, float64 ones ~1e-15. Writes ``benchmarks/results/mace_chunked_check.{md,json}``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch
from _common import write_results
from memory_wall import medium_model
from mlipdd.lattices import silicon_diamond
from mlipdd.testing.systems import triclinic
from mlipdd_mace import MACEWrapper
from mlipdd_mace.testing import random_mace


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def compare(label, raw, batch, chunks):
    ref = MACEWrapper(raw)(batch.clone(), compute_stress=True)
    rows = []
    for chunk in chunks:
        out = MACEWrapper(raw, chunk_atoms=chunk)(batch.clone(), compute_stress=True)
        rows.append({"model": label, "dtype": str(batch.positions.dtype).split(".")[-1], "atoms": batch.num_atoms,
                     "chunk_atoms": chunk, **{f"{k}_rel": rel(out[k].detach(), ref[k].detach())
                                              for k in ("energy", "forces", "stress")}})
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--atoms", type=int, default=4096)
    p.add_argument("--machine", default="")
    args = p.parse_args(argv)
    reps = max(1, round((args.atoms / 8) ** (1 / 3)))
    si = silicon_diamond(reps)
    # rattled: a perfect lattice has zero forces by symmetry
    si.node["positions"] = si.positions + 0.05 * torch.randn(si.positions.shape, generator=torch.Generator().manual_seed(0),
                                                             dtype=si.positions.dtype)
    si = si.to(device=args.device, dtype=torch.float32)
    rows = compare("medium", medium_model(args.device), si, (256, 2048))
    small = random_mace(elements=(1, 6, 8), r_max=4.0, channels=8, max_ell=3, correlation=3, dtype=torch.float64)
    tri = triclinic(species=(1, 6, 8), spacing=2.5, reps=8).to(device=args.device, dtype=torch.float64)
    rows += compare("small (8 ch, L=3, corr 3)", small.to(args.device), tri, (7, 100))
    table = write_results("mace_chunked_check", "Chunked MACE vs the plain model, one device", rows,
                          ["model", "dtype", "atoms", "chunk_atoms", "energy_rel", "forces_rel", "stress_rel"],
                          notes=args.machine)
    print(table)


if __name__ == "__main__":
    main()
