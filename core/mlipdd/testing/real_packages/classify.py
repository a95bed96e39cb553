"""Classify every real package's model: one process vs spawned gloo ranks.

The idiom zoo's machinery (`mlipdd.testing.idiom_zoo.classifier`): its systems
(triclinic cell, a cell where a rank sees its own images, a slab cut along its
vacuum), its tolerance (1e-10 relative on energy, forces and stress, float64), one
spawned group per world size for all cases (a refused case costs a fresh group, not
new processes), the references computed once per (model, system) in this process.
A case is a model, a storage (halo / sharded, the zoo's presets) and a system.

`validation` runs `trace_and_validate` on each model with its DEFAULT sample, under
halo and sharded storage: a model silently wrong in some case must fail there too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mlipdd.testing.conformance import build_model, distributed_outputs
from mlipdd.testing.idiom_zoo.classifier import (
    STRATEGIES,
    SYSTEMS,
    WORLD_SIZES,
    _acknowledge_a_simultaneous_failure,
    _compare,
    _failure_text,
    _options,
)
from mlipdd.testing.idiom_zoo.launch import run_cases


@dataclass(frozen=True)
class RealCase:
    model: str
    strategy: str
    system: str
    world_size: int
    outcome: str  # exact / refused / WRONG / HANG / CRASH (the zoo's OUTCOMES)
    detail: str = ""


def _run_case(rank, world_size, case):
    from mlipdd.testing.real_packages import REAL_MODELS

    _acknowledge_a_simultaneous_failure()
    model, strategy, system = case
    options = _options(strategy, system, world_size)
    out = distributed_outputs(rank, world_size, REAL_MODELS[model].factory, SYSTEMS[system](), options, True,
                              STRATEGIES[strategy])
    return {k: out[k] for k in ("atom_ids", "energy", "forces", "stress")}


def references(models: Iterable[str], systems: Iterable[str] = tuple(SYSTEMS)) -> dict:
    """One process's energy, forces and stress per (model, system), computed once."""
    from mlipdd.testing.real_packages import REAL_MODELS

    out = {}
    for model in models:
        wrapper = build_model(REAL_MODELS[model].factory)
        for system in systems:
            result = wrapper(SYSTEMS[system](), compute_stress=True)
            out[model, system] = {k: result[k].detach() for k in ("energy", "forces", "stress")}
    return out


def classify_world_size(models: Iterable[str], world_size: int, refs: dict,
                        strategies: Iterable[str] = tuple(STRATEGIES),
                        systems: Iterable[str] = tuple(SYSTEMS)) -> list[RealCase]:
    """Every (model, strategy, system) on ONE spawned group of ``world_size`` ranks."""
    cases = [(m, s, c) for m in models for s in strategies for c in systems]
    results = []
    for case, report in zip(cases, run_cases(_run_case, world_size, cases, 15.0, 120.0)):
        if report.done is None:
            results.append(RealCase(*case, world_size, *_failure_text(report)))
            continue
        reference = refs[case[0], case[2]]
        outcome, detail, _ = _compare(report.done, reference, reference["forces"].shape[0])
        results.append(RealCase(*case, world_size, outcome, detail))
    return results


def validation(model: str, strategies: Iterable[str] = tuple(STRATEGIES), world_size: int = 2) -> dict[str, tuple]:
    """``{strategy: (ok, first line of the diagnosis)}`` of `trace_and_validate` on ``model``
    with its default sample."""
    from mlipdd.testing.real_packages import REAL_MODELS
    from mlipdd.validate import trace_and_validate

    out = {}
    for strategy in strategies:
        report = trace_and_validate(REAL_MODELS[model].factory, world_size=world_size, strategy=strategy)
        out[strategy] = (report.ok, report.diagnosis.strip().splitlines()[0] if report.diagnosis.strip() else "")
    return out


__all__ = ["WORLD_SIZES", "RealCase", "classify_world_size", "references", "validation"]
