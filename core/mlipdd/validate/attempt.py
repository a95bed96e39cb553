"""One validation attempt: spawn ranks with a candidate spec and compare with the reference.

The worker reuses the conformance kit's `distributed_outputs` (partition from rank 0,
one distributed forward) and adds the rank's handler firings, so the report can say
which dispatch rules the run actually exercised.
"""

from __future__ import annotations

from collections import Counter

import torch

from mlipdd.testing.conformance import distributed_outputs, gather_by_id, relative_difference
from mlipdd.testing.spawn import RankFailure, run_ranks
from mlipdd.validate.report import Attempt, OutputDiff
from mlipdd.validate.translate import failure_line

COMPARED_OUTPUTS = ("energy", "forces", "stress")
# outputs every rank holds whole (per system); the auto-fix rules look at each rank's copy
REPLICATED_OUTPUTS = ("energy", "stress")


def validation_worker(rank, world_size, model_factory, batch, spec, config_kwargs, compute_stress):
    """Spawned rank: one distributed forward, plus which dispatch handlers fired."""
    from mlipdd.shard import registry

    registry.reset_counts()
    out = distributed_outputs(rank, world_size, model_factory, batch, config_kwargs, compute_stress, spec)
    out["fired"] = dict(registry.FIRED)
    return out


def default_tolerances(dtype: torch.dtype) -> dict[str, float]:
    """Relative tolerances per output (and ``atol``, below which any diff is noise)."""
    if dtype == torch.float64:
        return {"energy": 1e-9, "forces": 1e-8, "stress": 1e-8, "atol": 1e-12}
    return {"energy": 1e-4, "forces": 1e-3, "stress": 1e-3, "atol": 1e-6}


def compare(name: str, value: torch.Tensor | None, reference: torch.Tensor, tolerances: dict) -> OutputDiff:
    tol = tolerances.get(name, tolerances.get("default", 1e-8))
    if value is None or value.shape != reference.shape:
        return OutputDiff(abs=float("inf"), rel=float("inf"), tol=tol, ok=False)
    value = value.to(reference.dtype)
    abs_diff = float((value - reference).abs().max()) if value.numel() else 0.0
    rel = relative_difference(value, reference)
    ok = bool(rel <= tol or abs_diff <= tolerances.get("atol", 0.0))
    return OutputDiff(abs=abs_diff, rel=rel, tol=tol, ok=ok)


def run_attempt(number, change, spec, model_factory, batch, reference, world_size, tolerances,
                config_kwargs=None, timeout=300.0) -> Attempt:
    attempt = Attempt(number=number, spec=spec, change=change)
    compute_stress = "stress" in reference
    try:
        parts = run_ranks(validation_worker, world_size, model_factory, batch, spec, config_kwargs or {},
                          compute_stress, timeout=timeout)
    except RankFailure as failure:
        attempt.error = failure_line(failure)
        attempt.outputs = {"failures": failure.failures}
        return attempt
    fired = Counter()
    for part in parts:
        fired.update(part["fired"])
    attempt.handlers_fired = dict(fired)
    ids = torch.cat([p["atom_ids"] for p in parts])
    if not torch.equal(ids.sort().values, batch.atom_ids.sort().values):
        attempt.error = "atoms were lost or duplicated across ranks (a partition bug in mlipdd, not the model)"
        return attempt
    outputs = {"energy": parts[0]["energy"], "forces": gather_by_id(parts, "forces", batch.num_atoms)}
    if compute_stress:
        outputs["stress"] = parts[0]["stress"]
    attempt.outputs = outputs
    attempt.rank_outputs = [{k: p.get(k) for k in REPLICATED_OUTPUTS} for p in parts]
    for name in COMPARED_OUTPUTS:
        if name in reference:
            attempt.diffs[name] = compare(name, outputs.get(name), reference[name], tolerances)
    # a replicated output must agree across ranks too; rank 0's copy alone can look right
    for name in REPLICATED_OUTPUTS:
        if name in attempt.diffs and attempt.diffs[name].ok:
            for part in attempt.rank_outputs[1:]:
                other = compare(name, part.get(name), reference[name], tolerances)
                if not other.ok:
                    attempt.diffs[name] = other
                    break
    attempt.ok = bool(attempt.diffs) and all(d.ok for d in attempt.diffs.values())
    return attempt

