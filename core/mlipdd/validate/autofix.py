"""Auto-fix rules: a failed attempt's symptom -> a mutated spec to try next.

Each rule is ``rule(report, spec) -> MLIPSpec | None``: it looks at the last attempt in
``report`` (diffs, per-rank copies of replicated outputs, handler firings, error) and
proposes a spec that removes one recognised cause, or None when its symptom is absent.
`AUTOFIX_RULES` is tried in order; the validator skips proposals it has already run.
Rules come first when their symptom is unambiguous (a factor of world size, per-rank
partials that sum to the truth) and last when they are a plausible guess.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlipdd.spec import MLIPSpec, OutputKind
from mlipdd.testing.conformance import relative_difference
from mlipdd.validate.report import Attempt, ValidationReport
from mlipdd.validate.strategies import strategy_preset

Rule = Callable[[ValidationReport, MLIPSpec], "MLIPSpec | None"]

# how close a recognised pattern must be: loose, since a wrong spec is wrong by O(1)
_PATTERN_TOL = 1e-6


def _matches(value, reference) -> bool:
    if value is None or reference is None or value.shape != reference.shape:
        return False
    if not bool(reference.abs().max() > 0):
        return False  # a zero reference matches every multiple of itself
    return relative_difference(value.to(reference.dtype), reference) <= _PATTERN_TOL


def _wrong(attempt: Attempt, name: str) -> bool:
    diff = attempt.diffs.get(name)
    return diff is not None and not diff.ok


def _per_graph_outputs(spec: MLIPSpec) -> list[str]:
    """Per-system outputs the validator compares (energy and stress unless declared otherwise)."""
    names = ["energy", "stress"]
    return [n for n in names if spec.kind_of(n) in (OutputKind.PER_GRAPH, OutputKind.GLOBAL, OutputKind.UNKNOWN)]


def use_the_strategy_policy(report: ValidationReport, spec: MLIPSpec):
    """Symptom: the run refuses the spec because its policy does not fit the strategy the
    validator runs (a graph-partition spec under halo, a halo spec under graph partition).
    Fix: that strategy's storage policy with default rules (its preset's policy)."""
    attempt, preset = report.last, strategy_preset(report.strategy)
    if preset is not None and attempt.error and f"does not fit the {report.strategy} strategy" in attempt.error:
        return spec.replace(policy=preset[1].policy)
    return None


def drop_redundant_all_reduce(report: ValidationReport, spec: MLIPSpec):
    """Symptom: an output listed in ``all_reduce_outputs`` comes out exactly world_size
    times too big: it was already replicated (energy after per-system reductions), and
    summing W equal copies multiplies it. Fix: drop it from ``all_reduce_outputs``."""
    attempt, world = report.last, report.world_size
    redundant = set()
    for name in spec.all_reduce_outputs:
        reference = report.reference.get(name)
        if world > 1 and reference is not None and _wrong(attempt, name) \
                and _matches(attempt.outputs.get(name), world * reference):
            redundant.add(name)
    return spec.replace(all_reduce_outputs=spec.all_reduce_outputs - redundant) if redundant else None


def promote_partial_outputs(report: ValidationReport, spec: MLIPSpec):
    """Symptom: a per-system output (energy, stress) differs on every rank, yet the ranks'
    values add up to the single-process value: each rank holds a partial sum (stress from
    the strain route, energy summed without a reduction). Fix: add it to
    ``all_reduce_outputs``."""
    attempt = report.last
    if attempt.error or len(attempt.rank_outputs) < 2:
        return None
    partial = set()
    for name in _per_graph_outputs(spec):
        copies = [part.get(name) for part in attempt.rank_outputs]
        if name in spec.all_reduce_outputs or not _wrong(attempt, name) or any(c is None for c in copies):
            continue
        if _matches(torch.stack(copies).sum(0), report.reference.get(name)):
            partial.add(name)
    return spec.replace(all_reduce_outputs=spec.all_reduce_outputs | partial) if partial else None


def toggle_owned_only_forces(report: ValidationReport, spec: MLIPSpec):
    """Symptom: energy right, forces wrong. Forces marked owned-only skip the ghost
    back-exchange, so autograd partials left on ghost rows are lost; forces that are
    complete on the owner (computed directly) but accumulated get ghost rows added twice.
    Fix: flip ``forces`` between ``owned_only_outputs`` and accumulated."""
    attempt = report.last
    if attempt.error or not _wrong(attempt, "forces") or _wrong(attempt, "energy"):
        return None
    if report.strategy == "sharded":
        return None  # owned rows only: there are no ghost partials to keep or drop
    if "forces" in spec.owned_only_outputs:
        return spec.replace(owned_only_outputs=spec.owned_only_outputs - {"forces"})
    if "forces" in spec.all_reduce_outputs:
        return None
    return spec.replace(owned_only_outputs=spec.owned_only_outputs | {"forces"})


# NOTE [auto-fix under aten]
# The aten dispatch (halo and sharded storage) places every tensor itself: the spec's
# all_reduce_outputs / owned_only_outputs are not read there, so a rule that changes them
# would only rerun the same answer. What the aten dispatch reports is a refusal naming the
# op and its fix (the translator turns it into the diagnosis) or a wrong answer from what
# it took on the model's word (the rank trace names it); of the rules, only the one that
# answers the strategy's own refusal of the policy applies there.
PLACEMENT_RULES: tuple[Rule, ...] = (use_the_strategy_policy,)

AUTOFIX_RULES: tuple[Rule, ...] = (
    use_the_strategy_policy,
    drop_redundant_all_reduce,
    promote_partial_outputs,
    toggle_owned_only_forces,
)


def rules_for(report: ValidationReport) -> tuple[Rule, ...]:
    """The rules that can change the outcome of the report's runs (NOTE [auto-fix under aten])."""
    return PLACEMENT_RULES if report.placements_decide else AUTOFIX_RULES


def describe_change(old: MLIPSpec, new: MLIPSpec) -> str:
    """What differs between two specs, in spec-author terms."""
    changes = []
    if old.policy != new.policy:
        changes.append(f"policy {_policy_text(old.policy)} -> {_policy_text(new.policy)}")
    for field in ("all_reduce_outputs", "owned_only_outputs"):
        before, after = getattr(old, field), getattr(new, field)
        added = [f"+{n}" for n in sorted(after - before)]
        removed = [f"-{n}" for n in sorted(before - after)]
        if added or removed:
            changes.append(f"{field} {' '.join(added + removed)}")
    return "; ".join(changes) or "no change"


def _policy_text(policy) -> str:
    rules = ", ".join(f"{k}={v!r}" for k, v in policy.rules().items())
    return f"{type(policy).__name__}({rules})"
