"""Classify every zoo model: one process vs spawned gloo ranks, per strategy and system.

All cases of one world size run on ONE set of spawned ranks (`launch.run_cases`, which
reports each case as it finishes). A case that raises tears the process group down
(`mlipdd.comm.fail_together`: the failing rank aborts the group, the peers raise its
message), so the ranks stop there, join a fresh group and resume after it. A case
not finished on every rank is ``refused`` (with the originating rank's first line),
``HANG`` when a collective timed out or the ranks fell out of step in it, or ``CRASH``
when a rank died (gloo aborts a process on collectives of mismatched sizes); a case
finished on every rank is ``exact`` or ``WRONG`` against one process."""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mlipdd.spec.presets import SPEC_MPNN_HALO, SPEC_MPNN_SHARDED
from mlipdd.testing.conformance import distributed_outputs, gather_by_id, relative_difference
from mlipdd.testing.idiom_zoo.launch import OUT_OF_STEP, CaseReport, run_cases
from mlipdd.testing.systems import slab, small_cell, triclinic

SPECIES = (1, 8)
STRATEGIES = {"halo": SPEC_MPNN_HALO, "sharded": SPEC_MPNN_SHARDED}
SYSTEMS = {
    "triclinic": lambda: triclinic(species=SPECIES, spacing=3.0, reps=4),  # 64 atoms, angles ~60-70 deg
    "own_images": lambda: small_cell(species=SPECIES, spacing=2.6, reps=3),  # 27 atoms, a rank sees its images
    # cut along its vacuum (grid (1, 1, N)); six layers, so that no rank's owned atoms
    # and ghosts cover the whole slab (at 2 ranks), and some ranks own none (at 4)
    "slab": lambda: slab(species=SPECIES, spacing=3.0, reps=(3, 3, 6), vacuum=14.0),
}
WORLD_SIZES = (2, 3, 4)
TOLERANCE = 1e-10
OUTCOMES = ("exact", "refused", "WRONG", "HANG", "CRASH")
# Skin 0: the distributed lists then hold exactly the pairs within the cutoff, like the
# one-process list, so a model that counts or averages its edges is compared fairly.
DOMAIN_OPTIONS = {"skin": 0.0}


@dataclass(frozen=True)
class CaseResult:
    model: str
    strategy: str
    system: str
    world_size: int
    outcome: str  # one of OUTCOMES
    detail: str = ""  # refused/HANG/CRASH: the error's first line or the rank lost; WRONG: worst output
    max_rel: float | None = None  # largest relative difference (exact and WRONG)

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.model, self.strategy, self.system, self.world_size)


def _options(strategy: str, system: str, world_size: int) -> dict:
    grid = {"grid": (1, 1, world_size)} if system == "slab" else {}
    return {"strategy": strategy, **DOMAIN_OPTIONS, **grid}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _acknowledge_a_simultaneous_failure() -> None:
    """NOTE [simultaneous refusals]: when every rank raises the same refusal at once, each
    one may find the store still empty and publish; the later publishes lose and those
    ranks then wait, like the winner, for acknowledgements nobody sends (5 s per refused
    case on gloo). Here a rank that lost the race acknowledges the winner's message and
    stops waiting; outcomes and messages are unchanged, only the wait goes."""
    from mlipdd import group_abort

    rank = int(os.environ["RANK"])  # set by the launcher; the group is already torn down here

    wait = group_abort.wait_for_acknowledgements
    if getattr(wait, "idiom_zoo", False):
        return

    def wait_unless_another_rank_published(store, peers, timeout=group_abort.ACK_WAIT_S):
        failure = group_abort.read_failure(store)
        if failure is not None and failure[0] != rank:
            group_abort.acknowledge(store)
            return
        wait(store, peers, timeout)

    wait_unless_another_rank_published.idiom_zoo = True
    group_abort.wait_for_acknowledgements = wait_unless_another_rank_published


def _run_case(rank, world_size, case):
    """Worker: one distributed forward of ``case`` = (model, strategy, system)."""
    from mlipdd.testing.idiom_zoo import ZOO

    _acknowledge_a_simultaneous_failure()
    model, strategy, system = case
    out = distributed_outputs(rank, world_size, ZOO[model], SYSTEMS[system](),
                              _options(strategy, system, world_size), True, STRATEGIES[strategy])
    return {k: out[k] for k in ("atom_ids", "energy", "forces", "stress")}


def _failure_text(report: CaseReport) -> tuple[str, str]:
    """(outcome, first line) of a case the ranks did not all finish: a lost rank makes it
    a CRASH (died) or HANG (no progress); a collective that timed out or ranks out of
    step a HANG; else ``refused`` with the originating rank's error (a RemoteRankError
    relays it as "rank k failed: <message>")."""
    if report.lost:
        why = report.lost[0]
        return ("HANG" if "no progress" in why else "CRASH"), why
    failing = [(text, relayed) for _, text, relayed in report.errors]
    origin = [text for text, relayed in failing if not relayed]
    text = origin[0] if origin else failing[0][0].split(" failed: ", 1)[-1]
    hung = [t for t, _ in failing if OUT_OF_STEP in t or "timed out" in t.lower()]
    if hung:
        return "HANG", hung[0].split(" failed: ", 1)[-1]
    return "refused", text


def _compare(ranks: list[dict], reference: dict, n_atoms: int) -> tuple[str, str, float]:
    got = {"energy": ranks[0]["energy"], "forces": gather_by_id(ranks, "forces", n_atoms),
           "stress": ranks[0]["stress"]}
    diffs = {}
    for key, value in got.items():
        if value is None or value.shape != reference[key].shape:
            return "WRONG", f"{key} missing or shaped {None if value is None else tuple(value.shape)}", math.inf
        diff = relative_difference(value, reference[key])
        diffs[key] = math.inf if math.isnan(diff) else diff
    for r in ranks[1:]:
        if r["energy"].shape != ranks[0]["energy"].shape:
            return "WRONG", "energy shaped differently on the ranks", math.inf
        diffs["energy across ranks"] = max(diffs.get("energy across ranks", 0.0),
                                           relative_difference(r["energy"], ranks[0]["energy"]))
    worst = max(diffs, key=diffs.get)
    if diffs[worst] <= TOLERANCE:
        return "exact", "", diffs[worst]
    return "WRONG", f"{worst} {diffs[worst]:.1e}", diffs[worst]


def _references(models_systems: Iterable[tuple[str, str]]) -> dict:
    from mlipdd.testing.idiom_zoo import ZOO

    out = {}
    for model, system in models_systems:
        result = ZOO[model]()(SYSTEMS[system](), compute_stress=True)
        out[model, system] = {k: result[k].detach() for k in ("energy", "forces", "stress")}
    return out


def _classify_world_size(cases, world_size, references, collective_timeout_s, stall_s) -> list[CaseResult]:
    results = []
    for case, report in zip(cases, run_cases(_run_case, world_size, cases, collective_timeout_s, stall_s)):
        model, _, system = case
        if report.done is None:
            results.append(CaseResult(*case, world_size, *_failure_text(report)))
            continue
        reference = references[model, system]
        outcome, detail, worst = _compare(report.done, reference, reference["forces"].shape[0])
        results.append(CaseResult(*case, world_size, outcome, detail, worst))
    return results


def selection_outcomes(run_case, world_size: int, models: Iterable[str], system: str = "triclinic") -> dict:
    """``{model: (outcome, detail)}`` of each model on ``system`` at ``world_size`` ranks, run by
    ``run_case(rank, world_size, (model, system))`` in one launch: a test's zoo selection under
    options of its own (a strategy, a spec), classified as the zoo's table is."""
    cases = [(model, system) for model in models]
    references = _references(cases)
    outcomes = {}
    for (model, _), report in zip(cases, run_cases(run_case, world_size, cases, 15.0, 120.0)):
        if report.done is None:
            outcomes[model] = _failure_text(report)
            continue
        reference = references[model, system]
        outcomes[model] = _compare(report.done, reference, reference["forces"].shape[0])[:2]
    return outcomes


def classify(models: Iterable[str] | None = None, world_sizes: Iterable[int] = WORLD_SIZES,
             strategies: Iterable[str] = tuple(STRATEGIES), systems: Iterable[str] = tuple(SYSTEMS),
             collective_timeout_s: float = 15.0, stall_s: float = 120.0) -> list[CaseResult]:
    """Every (model, strategy, system) at every world size, one spawned group per world
    size (plus one more after each refused case). ``models``: names in `ZOO` (default:
    all). A collective that waits ``collective_timeout_s`` (a rank skipped it) or a group
    without progress for ``stall_s`` makes the case a HANG."""
    from mlipdd.testing.idiom_zoo import ZOO

    models = list(ZOO) if models is None else list(models)
    unknown = sorted(set(models) - set(ZOO))
    if unknown:
        raise ValueError(f"unknown zoo models {unknown}; choose from {sorted(ZOO)}")
    cases = [(m, s, c) for m in models for s in strategies for c in systems]
    references = _references(dict.fromkeys((m, c) for m, _, c in cases))
    results = []
    for world_size in world_sizes:
        results += _classify_world_size(cases, world_size, references, collective_timeout_s, stall_s)
    order = {case: i for i, case in enumerate(cases)}
    return sorted(results, key=lambda r: (r.world_size, order[r.model, r.strategy, r.system]))


def counts_by_strategy(results: list[CaseResult]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for r in results:
        per = counts.setdefault(r.strategy, dict.fromkeys(OUTCOMES, 0))
        per[r.outcome] += 1
    return counts


def _shortened(text: str, limit: int = 400) -> str:
    root = str(Path(__file__).resolve().parents[3])  # .../core: paths in messages as core/...
    text = text.replace(root, "core").replace("`", "'").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def markdown_table(results: list[CaseResult]) -> str:
    """Counts per strategy, then one row per model with one column per (strategy,
    system); a cell lists the world sizes that differ. Refusal messages are numbered
    below the table."""
    from mlipdd.testing.idiom_zoo import ZOO

    world_sizes = sorted({r.world_size for r in results})
    columns = list(dict.fromkeys((r.strategy, r.system) for r in results))
    models = list(dict.fromkeys(r.model for r in results))
    by_key = {r.key: r for r in results}
    notes: dict[str, int] = {}  # message with its numbers blanked -> note number
    examples: dict[str, str] = {}  # the same key -> the first full message

    def short(r: CaseResult) -> str:
        if r.outcome == "exact":
            return "exact"
        if r.outcome == "WRONG":
            return f"**WRONG** {r.detail}"
        key = re.sub(r"\d+", "#", r.detail)  # row counts, indices, line numbers differ per rank
        examples.setdefault(key, r.detail)
        note = notes.setdefault(key, len(notes) + 1)
        return f"{r.outcome} [{note}]"

    lines = [f"Cases per strategy (models x systems x world sizes {', '.join(map(str, world_sizes))}):", "",
             "| strategy | " + " | ".join(OUTCOMES) + " |", "|---|" + "---|" * len(OUTCOMES)]
    for strategy, per in counts_by_strategy(results).items():
        lines.append(f"| {strategy} | " + " | ".join(str(per[o]) for o in OUTCOMES) + " |")
    lines += ["", "| model | idiom | " + " | ".join(f"{s} {c}" for s, c in columns) + " |",
              "|---|---|" + "---|" * len(columns)]
    for model in models:
        cells = []
        for strategy, system in columns:
            per_ws = [(ws, short(by_key[model, strategy, system, ws])) for ws in world_sizes
                      if (model, strategy, system, ws) in by_key]
            texts = {text for _, text in per_ws}
            cells.append(per_ws[0][1] if len(texts) == 1 else "<br>".join(f"{ws}: {t}" for ws, t in per_ws))
        lines.append(f"| {model} | {ZOO[model].idiom} | " + " | ".join(cells) + " |")
    if notes:
        title = "Errors on the ranks (the originating rank's first line; one example per message up to its numbers):"
        lines += ["", title, ""]
        lines += [f"{n}. `{_shortened(examples[key])}`" for key, n in notes.items()]
    return "\n".join(lines)


def timed_classify(**kwargs) -> tuple[list[CaseResult], float]:
    start = time.perf_counter()
    results = classify(**kwargs)
    return results, time.perf_counter() - start


__all__ = ["OUTCOMES", "STRATEGIES", "SYSTEMS", "WORLD_SIZES", "CaseResult", "classify", "counts_by_strategy",
           "markdown_table", "timed_classify"]
