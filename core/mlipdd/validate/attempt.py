"""One validation attempt: spawn ranks with a candidate spec and compare with the reference.

The worker reuses the conformance kit's `distributed_outputs` (partition from rank 0,
one distributed forward) and adds the rank's rule firings, so the report can say which
aten rules the run exercised, what the rank's model could see of the system (NOTE
[conclusive sample] in `mlipdd.validate.coverage`) and what the dispatch took on the
model's word (`mlipdd.validate.rank_trace`).
"""

from __future__ import annotations

import functools
from collections import Counter

import torch

from mlipdd.testing.conformance import distributed_outputs, gather_by_id, relative_difference
from mlipdd.testing.spawn import RankFailure, run_ranks
from mlipdd.validate.coverage import RankView
from mlipdd.validate.rank_trace import watched_model
from mlipdd.validate.report import Attempt, OutputDiff
from mlipdd.validate.translate import failure_line

COMPARED_OUTPUTS = ("energy", "forces", "stress")
# outputs every rank holds whole (per system); the auto-fix rules look at each rank's copy
REPLICATED_OUTPUTS = ("energy", "stress")


def validation_worker(rank, world_size, model_factory, samples, spec, config_kwargs, compute_stress):
    """Spawned rank: one distributed forward per sample, each with the aten rules that fired,
    what the model saw of the system and what the dispatch took on the model's word."""
    outs = []
    for batch in samples:
        traces = []
        factory = functools.partial(watched_model, model_factory, traces)
        out = distributed_outputs(rank, world_size, factory, batch, config_kwargs, compute_stress, spec)
        trace = traces[0]
        out["fired"] = dict(trace.fired)
        out["view"] = {**trace.view, "owned": int(out["atom_ids"].shape[0])}
        out["suspects"] = dict(trace.suspects)
        outs.append(out)
    return outs


def rank_views(parts, total: int, holds_all: bool) -> list[RankView]:
    return [RankView(rank=r, owned=p["view"]["owned"], seen=p["view"]["seen"], total=total, holds_all=holds_all)
            for r, p in enumerate(parts)]


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


def run_attempt(number, change, spec, model_factory, samples, references, world_size, tolerances,
                config_kwargs=None, timeout=300.0, holds_all: bool = False) -> Attempt:
    """Every sample (the first is the one the report's outputs and the auto-fix rules
    see; the others are the same cell in other positions, NOTE [conclusive sample]) on
    ``world_size`` spawned ranks, in one launch. ``holds_all``: the strategy gives every
    rank the whole system by design (graph partition); its coverage check is then on the
    owned blocks."""
    attempt = Attempt(number=number, spec=spec, change=change)
    compute_stress = "stress" in references[0]
    try:
        per_rank = run_ranks(validation_worker, world_size, model_factory, samples, spec, config_kwargs or {},
                             compute_stress, timeout=timeout)
    except RankFailure as failure:
        attempt.error = failure_line(failure)
        attempt.outputs = {"failures": failure.failures}
        return attempt
    fired, suspects = Counter(), Counter()
    for index, (batch, reference) in enumerate(zip(samples, references)):
        parts = [outs[index] for outs in per_rank]
        for part in parts:
            fired.update(part["fired"])
            suspects.update(part["suspects"])
        views = rank_views(parts, batch.num_atoms, holds_all)
        attempt.views.append(views)
        checked = _check_sample(parts, batch, reference, tolerances, compute_stress)
        if isinstance(checked, str):
            attempt.error = checked
            return attempt
        outputs, rank_outputs, diffs = checked
        if index == 0:
            attempt.outputs, attempt.rank_outputs, attempt.diffs = outputs, rank_outputs, diffs
        else:  # another position of the cell: its first wrong output is the one reported
            for name, diff in diffs.items():
                if not diff.ok and attempt.diffs.get(name, diff).ok:
                    attempt.diffs[name] = diff
    attempt.handlers_fired = dict(fired)
    attempt.unruled_suspects = dict(suspects)
    attempt.ok = bool(attempt.diffs) and all(d.ok for d in attempt.diffs.values())
    return attempt


def _check_sample(parts, batch, reference, tolerances, compute_stress):
    """``(outputs, per-rank replicated outputs, diffs)`` of one sample, or an error line."""
    ids = torch.cat([p["atom_ids"] for p in parts])
    if not torch.equal(ids.sort().values, batch.atom_ids.sort().values):
        return "atoms were lost or duplicated across ranks (a partition bug in mlipdd, not the model)"
    outputs = {"energy": parts[0]["energy"], "forces": gather_by_id(parts, "forces", batch.num_atoms)}
    if compute_stress:
        outputs["stress"] = parts[0]["stress"]
    rank_outputs = [{k: p.get(k) for k in REPLICATED_OUTPUTS} for p in parts]
    diffs = {}
    for name in COMPARED_OUTPUTS:
        if name in reference:
            diffs[name] = compare(name, outputs.get(name), reference[name], tolerances)
    # a replicated output must agree across ranks too; rank 0's copy alone can look right
    for name in REPLICATED_OUTPUTS:
        if name in diffs and diffs[name].ok:
            for part in rank_outputs[1:]:
                other = compare(name, part.get(name), reference[name], tolerances)
                if not other.ok:
                    diffs[name] = other
                    break
    return outputs, rank_outputs, diffs
