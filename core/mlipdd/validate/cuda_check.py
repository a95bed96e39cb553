"""The CUDA leg of validation: one rank on the GPU (NCCL) against the CPU reference.

Multi-rank correctness is established on CPU ranks; this only checks that the model and
the spec also run on the device and give the same numbers there.
"""

from __future__ import annotations

import torch

from mlipdd.testing.spawn import RankFailure, run_ranks
from mlipdd.validate.attempt import compare
from mlipdd.validate.translate import failure_line


def cuda_worker(rank, world_size, model_factory, batch, spec, compute_stress, strategy="halo"):
    from mlipdd.distributed import DistributedModel, DomainConfig

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    model = model_factory().to(device)
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, strategy=strategy), spec=spec)
    owned = dm.partition(batch if rank == 0 else None, device=device)
    out = dm(owned, compute_stress=compute_stress)
    order = torch.argsort(owned.atom_ids)
    return {"energy": out["energy"], "forces": out["forces"][order], "stress": out.get("stress")}


def cuda_check(model_factory, batch, report, timeout: float = 300.0) -> str:
    """A one-line note for the report: what the CUDA run showed (or why there was none)."""
    if not torch.cuda.is_available():
        return "CUDA was requested but is not available here; validated on CPU ranks (gloo) only"
    spec = report.spec if report.spec is not None else report.last.spec
    compute_stress = "stress" in report.reference
    try:
        (out,) = run_ranks(cuda_worker, 1, model_factory, batch, spec, compute_stress, report.strategy,
                           backend="nccl", timeout=timeout)
    except RankFailure as failure:
        return f"CUDA single-rank check failed: {failure_line(failure)}"
    diffs = {name: compare(name, out.get(name), report.reference[name], report.tolerances)
             for name in ("energy", "forces", "stress") if name in report.reference}
    verdict = "passed" if all(d.ok for d in diffs.values()) else "DIFFERS"
    detail = ", ".join(f"{name} rel {d.rel:.1e}" for name, d in diffs.items())
    return f"CUDA single-rank check (nccl, cuda:0) {verdict}: {detail}"
