"""What `trace_and_validate` hands back: a verdict, a working spec, and what to do next."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

SAVE_HINT = "save it: report.spec.save('model_spec.json')"


@dataclass
class OutputDiff:
    """One output, distributed vs single process: max abs diff, and that over max |ref|."""

    abs: float
    rel: float
    tol: float
    ok: bool

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "WRONG"
        return f"rel {self.rel:.2e}  abs {self.abs:.2e}  (tol {self.tol:.0e})  {verdict}"


@dataclass
class Attempt:
    """One distributed run with one candidate spec."""

    number: int
    spec: Any
    change: str  # how this spec was obtained ("initial: ..." or "rule: what changed")
    ok: bool = False
    diffs: dict[str, OutputDiff] = field(default_factory=dict)
    handlers_fired: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # the failing rank's exception line, when a rank raised
    # per sample, what each rank's model could read of it (NOTE [conclusive sample])
    views: list = field(default_factory=list)
    # ops on atom/edge rows that ran without a dispatch rule and are not row-local, all ranks
    unruled_suspects: dict[str, int] = field(default_factory=dict)
    # raw material for the auto-fix rules (not shown in summaries)
    outputs: dict = field(default_factory=dict, repr=False)  # gathered distributed outputs
    rank_outputs: list = field(default_factory=list, repr=False)  # per-rank replicated outputs

    @property
    def spec_name(self) -> str:
        return getattr(self.spec, "name", "") or "(unnamed spec)"

    @property
    def outcome(self) -> str:
        if self.ok:
            return "passed"
        if self.error:
            return f"raised: {self.error}"
        wrong = [name for name, diff in self.diffs.items() if not diff.ok]
        return "wrong " + ", ".join(f"{n} (rel {self.diffs[n].rel:.1e})" for n in wrong)


@dataclass
class ValidationReport:
    """``ok``: the distributed run matches one process within tolerance.

    ``spec`` is the spec that passed (None when none did), ready for
    ``spec.save(path)``; ``next_action`` always says what to do now.
    """

    ok: bool = False
    spec: Any = None
    attempts: list[Attempt] = field(default_factory=list)
    world_size: int = 2
    strategy: str = "halo"  # the decomposition strategy the ranks ran
    placements_decide: bool = False  # halo / sharded at several ranks: NOTE [auto-fix under aten]
    diffs: dict[str, OutputDiff] = field(default_factory=dict)
    handlers_fired: dict[str, int] = field(default_factory=dict)
    coverage: list = field(default_factory=list)  # per sample, a `RankView` per rank (last attempt)
    warnings: list[str] = field(default_factory=list)  # e.g. a sample too small to be conclusive
    op_counts: Counter = field(default_factory=Counter, repr=False)
    opaque_ops: list[str] = field(default_factory=list)
    diagnosis: str = ""
    next_action: str = ""
    notes: list[str] = field(default_factory=list)
    tolerances: dict[str, float] = field(default_factory=dict)
    reference: dict = field(default_factory=dict, repr=False)

    @property
    def last(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def conclusive(self) -> bool:
        """False when some rank saw every atom: a pass then proves less (NOTE [conclusive sample])."""
        return not any(view.inconclusive for views in self.coverage for view in views)

    @property
    def fixes_applied(self) -> list[str]:
        return [a.change for a in self.attempts[1:]]

    def summary(self) -> str:
        """The multi-line summary `log_summary` logs (also what ``mlipdd validate`` prints)."""
        n = len(self.attempts)
        plural = "attempt" if n == 1 else "attempts"
        status = "PASSED" if self.ok else "FAILED"
        spec_name = self.spec.name if self.ok and self.spec is not None else None
        if n == 0:  # the model or the reference run failed before any rank started
            lines = [f"validation {status} before any distributed run"]
            lines += [f"note: {note}" for note in self.notes]
            return "\n".join([*lines, f"Diagnosis: {self.diagnosis}", f"Next: {self.next_action}"])
        head = f"validation {status} in {n} {plural} on {self.world_size} ranks ({self.strategy} strategy)"
        head += f" (spec {spec_name!r})" if spec_name else ""
        lines = [head + (": not conclusive, see the warning" if self.ok and not self.conclusive else "")]
        lines += [f"WARNING: {warning}" for warning in self.warnings]
        fixes = self.fixes_applied
        lines.append("auto-fix applied: none" if not fixes else "auto-fix applied:")
        lines += [f"  {fix}" for fix in fixes]
        if n > 1 or not self.ok:
            lines.append("attempts:")
            lines += [f"  {a.number}. {a.spec_name}: {a.outcome}" for a in self.attempts]
        if self.diffs:
            lines.append("diff vs single process:")
            width = max(len(name) for name in self.diffs)
            lines += [f"  {name:<{width}}  {diff}" for name, diff in self.diffs.items()]
        fired = ", ".join(f"{k}={v}" for k, v in sorted(self.handlers_fired.items())) or "none"
        lines.append(f"aten rules fired (all ranks): {fired}")
        lines.append(f"opaque custom ops: {', '.join(self.opaque_ops) or 'none'}")
        if self.coverage:
            from mlipdd.validate.coverage import coverage_line

            texts = [coverage_line(views) for views in self.coverage]
            if len(set(texts)) == 1:
                where = f" (each of {len(texts)} samples)" if len(texts) > 1 else ""
                lines.append(f"coverage{where}: {texts[0]}")
            else:
                lines += [f"coverage (sample {i + 1} of {len(texts)}): {text}" for i, text in enumerate(texts)]
        suspects = self.last.unruled_suspects
        if suspects and not self.ok:
            listed = ", ".join(f"{op} x{count}" for op, count in suspects.items())
            lines.append(f"taken on the model's word (all ranks): {listed}")
        lines += [f"note: {note}" for note in self.notes]
        if self.diagnosis:
            lines.append(f"Diagnosis: {self.diagnosis}")
        lines.append(f"Next: {self.next_action}")
        return "\n".join(lines)

    def log_summary(self, logger: logging.Logger | None = None, level: int | None = None) -> str:
        """Log the summary (INFO when ok on a conclusive sample, WARNING otherwise) and return it."""
        text = self.summary()
        logger = logger or logging.getLogger("mlipdd.validate")
        fine = self.ok and self.conclusive
        logger.log(level if level is not None else (logging.INFO if fine else logging.WARNING), text)
        return text

    def __str__(self) -> str:
        return self.summary()
