"""`trace_and_validate`: reference run, spawned ranks, diff, auto-fix, diagnosis.

Flow: build the model and run it single-process on the sample under an `OpTrace`
(the truth, plus which ops it uses) -> pick the candidate spec for the strategy (halo,
sharded, graph partition) -> run ``world_size`` spawned gloo ranks under that strategy
and compare -> on a wrong answer (or a spec the strategy refuses), the first auto-fix
rule that recognises the symptom proposes a spec and the ranks run again -> on a
raised error, the translator turns it into a diagnosis and a fix.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from mlipdd.data import InputError
from mlipdd.validate.attempt import default_tolerances, run_attempt
from mlipdd.validate.autofix import describe_change, rules_for
from mlipdd.validate.coverage import coverage_warning, default_samples
from mlipdd.validate.cuda_check import cuda_check
from mlipdd.validate.op_trace import OpTrace
from mlipdd.validate.rank_trace import suspects_advice
from mlipdd.validate.report import SAVE_HINT, ValidationReport
from mlipdd.validate.strategies import strategy_name, strategy_preset, whole_system
from mlipdd.validate.translate import (
    Context,
    model_frame,
    opaque_op_advice,
    origin_traceback,
    translate,
)


def _as_wrapper(model):
    if isinstance(model, torch.nn.Module) and hasattr(model, "model_config"):
        return model
    from mlipdd.plugins import wrap_model

    return wrap_model(model)


def initial_spec(model, strategy: str, spec=None):
    """``(spec, where it came from)``: the one passed in, the wrapper's own for this
    strategy, or the strategy's preset for plain models."""
    if spec is not None:
        return spec, "the spec passed in"
    own = model.distribution_spec(strategy)
    if own is not None:
        return own, f"the wrapper's distribution_spec({strategy!r})"
    preset = strategy_preset(strategy)
    if preset is None:
        raise InputError(
            f"the model declares no spec for the {strategy!r} strategy and there is no default "
            "for it; pass spec=... (or have the wrapper's distribution_spec return one)"
        )
    return preset[1], f"the {strategy} default {preset[0]}"


PLACEMENTS_NOTE = ("under the aten dispatch each tensor's placement decides what crosses ranks: the spec's "
                   "all_reduce_outputs / owned_only_outputs are not read (the auto-fix rules that change them "
                   "are skipped)")


def placements_decide(strategy: str, world_size: int) -> bool:
    """Whether the strategy goes by placements (halo and sharded storage at several ranks)
    rather than reading the spec's output fields (NOTE [auto-fix under aten])."""
    from mlipdd.plugins import get_strategy
    from mlipdd.strategy import HaloStrategy, ShardedStrategy

    return issubclass(get_strategy(strategy), (HaloStrategy, ShardedStrategy)) and world_size > 1


def _spec_key(spec) -> str:
    try:
        return json.dumps(spec.to_dict(), sort_keys=True, default=str)
    except Exception:  # noqa: BLE001 - a spec that does not serialise is still comparable by repr
        return repr(spec)


def _fail(report: ValidationReport, error: BaseException, stage: str) -> ValidationReport:
    import traceback

    text = "".join(traceback.format_exception(error))
    ctx = Context(where=model_frame(text), strategy=report.strategy)
    report.diagnosis, report.next_action = translate(text, ctx, stage=stage)
    return report


def trace_and_validate(model_factory: Callable, sample_batch=None, world_size: int = 2, spec=None,
                       max_attempts: int = 4, tolerances: dict | None = None, device=None,
                       timeout: float = 300.0, strategy="halo") -> ValidationReport:
    """Check that ``model_factory()`` runs distributed exactly as single-process.

    ``strategy``: ``"halo"`` (default), ``"sharded"`` or ``"graph_partition"`` (or a
    `StrategyKind`); the ranks run `DistributedModel` under it. ``sample_batch=None``
    picks a cell sized to the model's cutoff and ``world_size`` in which no rank sees every
    atom, in as many positions as make every atom invisible to some rank in one of them
    (`mlipdd.validate.coverage.default_samples`); a `Batch` (or a list of them, each
    checked) in which some rank sees every atom is run too, with a warning in the report
    that a pass there is not conclusive. ``model_factory`` must
    be picklable (a module-level function, or ``functools.partial`` of a class) because
    each spawned rank calls it. Returns a `ValidationReport`; when ``report.ok``, ``report.spec`` is ready
    for ``save``.
    """
    report = ValidationReport(world_size=world_size, strategy=str(getattr(strategy, "value", strategy)))
    try:
        report.strategy = strategy_name(strategy)
    except InputError as exc:
        return _fail(report, exc, "strategy choice")
    try:
        model = _as_wrapper(model_factory())
        if sample_batch is None:
            samples = default_samples(model, world_size)
            if whole_system(report.strategy):  # every rank sees it all anyway
                samples = samples[:1]
        else:
            samples = list(sample_batch) if isinstance(sample_batch, (list, tuple)) else [sample_batch]
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the report is the answer
        return _fail(report, exc, "model factory")
    try:
        report.placements_decide = placements_decide(report.strategy, world_size)
    except InputError as exc:
        return _fail(report, exc, "strategy choice")
    batch = samples[0]
    report.tolerances = {**default_tolerances(batch.dtype), **(tolerances or {})}
    trace = OpTrace()
    try:
        with trace:
            reference = model(batch.clone(), compute_stress=True)
    except Exception as exc:  # noqa: BLE001
        return _fail(report, exc, "single-process reference run")
    report.reference = _detached(reference)
    try:  # the same cell in its other positions (NOTE [conclusive sample])
        references = [report.reference] + [_detached(model(s.clone(), compute_stress=True)) for s in samples[1:]]
    except Exception as exc:  # noqa: BLE001
        return _fail(report, exc, "single-process reference run")
    report.op_counts = trace.counts
    report.opaque_ops = trace.opaque_ops
    bad = [k for k in ("energy", "forces", "stress") if k in report.reference
           and not bool(torch.isfinite(report.reference[k]).all())]
    if bad:
        report.diagnosis = f"the single-process {', '.join(bad)} already contain NaN/inf"
        report.next_action = "fix the model (or the sample batch) single-process first, then re-validate"
        return report

    forces = report.reference.get("forces")
    if forces is not None and not bool(forces.abs().max() > 0):
        report.notes.append("the reference forces are all zero (no interacting pairs?): this check "
                            "proves little; pass a denser sample_batch or check the model's cutoff")
    try:
        candidate, source = initial_spec(model, report.strategy, spec)
    except InputError as exc:
        return _fail(report, exc, "spec choice")
    report.notes.append(f"initial spec {candidate.name or '(unnamed)'!r} from {source}")
    if report.placements_decide:
        report.notes.append(PLACEMENTS_NOTE)
    if sample_batch is None:
        where = (f", run in {len(samples)} positions along the cut axis (each atom out of some rank's sight "
                 "in one)") if len(samples) > 1 else ""
        report.notes.append(f"sample: the default long triclinic cell of {batch.num_atoms} atoms for cutoff "
                            f"{model.cutoff:g} on {world_size} ranks{where}")
    _attempt_loop(report, candidate, model_factory, samples, references, max_attempts, timeout)
    skin = _skin_edges_matter(model, batch, report)
    _conclude(report, max_attempts, skin)
    if device is not None and str(device).startswith("cuda"):
        report.notes.append(cuda_check(model_factory, batch, report, timeout))
    return report


def _detached(outputs: dict) -> dict:
    return {k: v.detach() for k, v in outputs.items() if torch.is_tensor(v)}


def _attempt_loop(report, spec, model_factory, samples, references, max_attempts, timeout) -> None:
    tried = {_spec_key(spec)}
    change = "initial spec"
    for number in range(1, max(1, max_attempts) + 1):
        attempt = run_attempt(number, change, spec, model_factory, samples, references,
                              report.world_size, report.tolerances,
                              config_kwargs={"strategy": report.strategy},
                              timeout=timeout, holds_all=whole_system(report.strategy))
        report.attempts.append(attempt)
        if attempt.ok:
            return
        proposal = None
        for rule in rules_for(report):
            candidate = rule(report, spec)
            if candidate is not None and _spec_key(candidate) not in tried:
                proposal = (rule.__name__, candidate)
                break
        if proposal is None or number == max_attempts:
            report.notes.append("no auto-fix rule matched the last attempt" if proposal is None else
                                f"stopped after max_attempts={max_attempts}; {proposal[0]} had one more idea")
            return
        rule_name, new_spec = proposal
        change = f"{rule_name}: {describe_change(spec, new_spec)}"
        base = spec.name.removesuffix("+autofix") or "spec"
        spec = new_spec.replace(name=f"{base}+autofix")
        tried.add(_spec_key(spec))


def _skin_edges_matter(model, batch, report: ValidationReport):
    """After a wrong answer (no error): the failed `check_ignores_skin_edges` when edges in
    the ranks' skin change the model's answer in one process already, else None. The ranks'
    lists hold edges up to ``cutoff + skin``, the reference's only those within the cutoff;
    no dispatch can tell such an edge from another (a degree by ``bincount`` counts it)."""
    last = report.last
    if last is None or last.ok or last.error:
        return None
    from mlipdd.distributed.config import DomainConfig
    from mlipdd.validate.rank_checks import check_ignores_skin_edges

    try:
        check = check_ignores_skin_edges(model, batch.clone(), DomainConfig(cutoff=float(model.cutoff)).skin)
    except Exception:  # noqa: BLE001 - the check is a hint; the wrong answer stands without it
        return None
    return None if check.ok else check


def _conclude(report: ValidationReport, max_attempts: int, skin=None) -> None:
    last = report.last
    report.diffs = last.diffs
    report.handlers_fired = last.handlers_fired
    report.ok = last.ok
    report.coverage = last.views
    warning = next((w for w in map(coverage_warning, last.views) if w), None)
    if warning:
        report.warnings.append(warning)
    if last.ok:
        report.spec = last.spec
        report.next_action = SAVE_HINT
        if warning:
            report.next_action += ("; but the sample was too small to prove the model exact: validate "
                                   "again on the default sample (sample_batch=None) or a larger cell")
        if len(report.attempts) > 1:
            first = report.attempts[0]
            report.diagnosis = (f"the initial spec {first.spec_name!r} did not pass ({first.outcome}); "
                                f"auto-fixed: {'; '.join(report.fixes_applied)}")
            report.next_action += " (or put the fixed spec in the wrapper's distribution_spec)"
        return
    covered = {adapter.qualified_name for adapter in last.spec.distribution.custom_ops}
    uncovered = [op for op in report.opaque_ops if op.removesuffix(".default") not in covered]
    if last.error:
        failures = last.outputs.get("failures", {})
        text = origin_traceback(failures) if failures else last.error
        ctx = Context(opaque_ops=uncovered, where=model_frame(text), strategy=report.strategy)
        report.diagnosis, report.next_action = translate(text, ctx)
        return
    wrong = ", ".join(f"{n} (rel {d.rel:.1e})" for n, d in last.diffs.items() if not d.ok)
    if skin is not None:  # the neighbour list, not the decomposition: one process shows it
        found, _, fix = skin.message.partition(". Distributed neighbour lists carry a skin, so ")
        report.diagnosis = (f"wrong {wrong}: edges beyond the cutoff change the answer in one process already "
                            f"({found}); the ranks' neighbour lists hold those edges (cutoff + skin)")
        report.next_action = (f"{fix or skin.message}; then re-validate" if fix else skin.message)
    elif uncovered:
        report.diagnosis, report.next_action = opaque_op_advice(uncovered)
        report.diagnosis = f"wrong {wrong}: " + report.diagnosis
    elif report.opaque_ops:
        ops = ", ".join(report.opaque_ops)
        report.diagnosis = f"wrong {wrong} although the spec declares OpAdapters for {ops}"
        report.next_action = ("check each OpAdapter's transforms: arguments with owned rows need "
                              "GatherInputs(), per-atom partial outputs ScatterOutputs(), per-rank "
                              "partial sums AllReduceSum()")
    elif last.unruled_suspects:
        report.diagnosis, report.next_action = suspects_advice(wrong, last.unruled_suspects)
    else:
        report.diagnosis = (f"wrong {wrong} after {len(report.attempts)} attempt(s), although every op on "
                            "distributed rows ran through an aten rule")
        report.next_action = (
            "look for what the dispatch cannot see: computations on mlipdd.shard.local(...) tensors, plain "
            "tensors built from Python numbers of this rank (len(batch), .tolist()), custom ops and their "
            "OpAdapters, and values passed between calls outside the batch; then re-validate"
        )
