"""Two rules a model must keep that the output comparison alone explains badly; each check
has its own message naming the fix.

* `check_identical_weights`: every rank builds the model itself (from the factory), so
  every rank must end up with the same weights; an unseeded random init silently gives
  each rank a different model.
* `check_ignores_skin_edges`: domain-decomposed neighbour lists are built with
  ``cutoff + skin`` (rebuilt only every few steps), so they hold edges longer than the
  cutoff; such an edge must contribute exactly nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlipdd.data import Batch


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    message: str

    def line(self) -> str:
        return f"[{'ok' if self.ok else 'FAIL'}] {self.name}: {self.message}"


def model_species(model) -> tuple[int, ...] | None:
    """The atomic numbers a wrapper declares (``model_config.extra['atomic_numbers']``)."""
    extra = getattr(getattr(model, "model_config", None), "extra", None) or {}
    species = extra.get("atomic_numbers") or extra.get("species")
    return tuple(int(z) for z in species) if species else None


def _weights_digest(rank: int, world_size: int, factory: Callable) -> dict[str, str]:
    model = factory()
    return {name: hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
            for name, t in model.state_dict().items() if torch.is_tensor(t)}


def check_identical_weights(factory: Callable, world_size: int = 2) -> CheckResult:
    """Build the model on ``world_size`` spawned ranks and compare every tensor's bytes."""
    from mlipdd.testing.spawn import run_ranks

    name = "identical weights on every rank"
    digests = run_ranks(_weights_digest, world_size, factory)
    for rank, digest in enumerate(digests[1:], start=1):
        differing = [k for k in digests[0] if digest.get(k) != digests[0][k]]
        missing = sorted(set(digest) ^ set(digests[0]))
        if differing or missing:
            what = f"tensor {(differing or missing)[0]!r}" + (
                f" and {len(differing or missing) - 1} more" if len(differing or missing) > 1 else "")
            return CheckResult(name, False, (
                f"rank {rank} built different weights than rank 0 ({what}). Every rank builds the "
                "model from the factory, so the factory must give identical weights: seed it "
                "(torch.manual_seed(0) or a torch.Generator inside the factory) or load the "
                "weights from a file"))
    return CheckResult(name, True, f"{len(digests[0])} tensors agree on {world_size} ranks")


def check_ignores_skin_edges(model, batch: Batch, skin: float = 1.0) -> CheckResult:
    """The model's outputs with a list built at ``cutoff`` vs one built at ``cutoff + skin``."""
    from mlipdd.neighbors import build_neighbor_list

    name = "edges beyond the cutoff contribute nothing"
    outputs = []
    for reach in (model.cutoff, model.cutoff + skin):
        sample = batch.clone()
        sample.neighbors = build_neighbor_list(sample, reach)
        with torch.enable_grad():
            out = model(sample, compute_stress=False)
        outputs.append({k: out[k].detach() for k in ("energy", "forces") if k in out})
    tight, loose = outputs
    rtol = 1e-10 if batch.positions.dtype == torch.float64 else 1e-5
    for key in tight:
        scale = float(tight[key].abs().max()) or 1.0
        diff = float((loose[key] - tight[key]).abs().max())
        if diff > rtol * scale:
            return CheckResult(name, False, (
                f"the {key} changes by {diff:.3g} (relative {diff / scale:.2g}) when the neighbour "
                f"list also holds edges up to cutoff + {skin} A. Distributed neighbour lists carry a "
                "skin, so an edge at r >= cutoff must add exactly zero: mask it "
                "(torch.where(r < cutoff, term, 0)) or use a cutoff function that is exactly 0 "
                "beyond the cutoff"))
    return CheckResult(name, True, f"identical with a {skin} A skin on the neighbour list")


def run_all(factory: Callable, sample: Batch | None, world_size: int = 2) -> list[CheckResult]:
    """Both checks, each printed as one line (`mlipdd validate`); ``sample=None`` picks
    validation's default cell for the model."""
    model = factory()
    if sample is None:
        from mlipdd.validate.coverage import default_sample

        sample = default_sample(model, world_size)
    checks = [check_identical_weights(factory, world_size), check_ignores_skin_edges(model, sample)]
    for check in checks:
        print(check.line())
    return checks
