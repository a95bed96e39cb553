"""cuEquivariance MACE under domain decomposition on ONE GPU equals one cuEq process (issue 23 item 1).

    python benchmarks/cueq_dd_gpu.py [--ranks 2,3] [--out DIR] [--name cueq_dd_gpu] [--chunk-atoms 8]

Gloo ranks share the GPU; each builds the small cuEq MACE (`SMALL_CUEQ_ARCH`, mace's converter
on CUDA: fused convolutions, cuEq's CUDA kernels) and runs it under halo and sharded storage on
a triclinic cell, a cell whose ranks see their own images and a slab, float64 (1e-10) and float32
(5e-5), against the same model in one process on the same GPU. A check run by the device tool
(CI has no GPU); prints a table and writes results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch
from _common import RESULTS, machine

TOLERANCE = {torch.float64: 1e-10, torch.float32: 5e-5}


def main() -> None:
    from mlipdd.testing.conformance import check_conformance_cases
    from mlipdd_mace.testing import SMALL_CUEQ_ARCH, cueq_mace_wrapper, small_cueq_systems

    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="2,3")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    p.add_argument("--name", default="cueq_dd_gpu")
    p.add_argument("--device", default="cuda", help="cpu: the same on cuEq's torch reference kernels")
    p.add_argument("--chunk-atoms", type=int, default=None,
                   help="chunked cuEq (MACEWrapper(chunk_atoms=N)) on both sides: small N, several chunks a rank")
    args = p.parse_args()
    rows = []
    for dtype in (torch.float64, torch.float32):
        factory = functools.partial(cueq_mace_wrapper, device=args.device, chunk_atoms=args.chunk_atoms,
                                    **{**SMALL_CUEQ_ARCH, "dtype": dtype})
        cases, names = [], []
        for system, batch in small_cueq_systems().items():
            for strategy in ("halo", "sharded"):
                cases.append((factory, batch.to(dtype=dtype), {"strategy": strategy}))
                names.append((system, strategy))
        for ranks in (int(r) for r in args.ranks.split(",")):
            for (result, _), (system, strategy) in zip(check_conformance_cases(cases, ranks, device=args.device), names):
                worst = max(result.rel_diff.values())
                rows.append({"ranks": ranks, "dtype": str(dtype).removeprefix("torch."), "strategy": strategy,
                             "system": system, **{k: float(v) for k, v in result.rel_diff.items()},
                             "ok": worst <= TOLERANCE[dtype]})
                print(rows[-1], flush=True)
    info = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    lines = ["# cuEq MACE under DD on one GPU (gloo ranks sharing it) vs one cuEq process\n",
             (f"Machine: {info}. Small cuEq MACE (SMALL_CUEQ_ARCH), mace's converter on CUDA (fused "
              "convolutions)" + (f", chunked: chunk_atoms={args.chunk_atoms} on both sides" if args.chunk_atoms else "")
              + ". Relative difference; tolerance 1e-10 (float64), 5e-5 (float32).\n"),
             "| ranks | dtype | strategy | system | energy | forces | stress | ok |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['ranks']} | {r['dtype']} | {r['strategy']} | {r['system']} | {r['energy']:.1e} | "
              f"{r['forces']:.1e} | {r['stress']:.1e} | {'yes' if r['ok'] else 'NO'} |" for r in rows]
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
