"""A model's spec chooser, without a closed list of strategy names.

A wrapper with one spec per storage (AIMNet2: sharded and halo; UMA: halo and graph
parallel) answers ``distribution_spec(strategy)`` by asking the strategy registered under
that name which of its specs it accepts (`Strategy.accepts`), so a third party's
strategy gets the spec that fits its storage, and one that fits none is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlipdd.spec.errors import SpecError


def strategy_name(strategy) -> str:
    """A strategy given by name, or as a `StrategyKind` member, as its registered name."""
    return str(getattr(strategy, "value", strategy))


def fitting_spec(strategy, specs: Sequence[Callable], model: str):
    """The first of ``specs`` (zero-argument factories, built in order until one fits)
    whose storage policy the strategy registered as ``strategy`` accepts; ``strategy=None``
    (the model's own default): the first. ``model`` names the model in the error."""
    if strategy is None:
        return specs[0]()
    from mlipdd.plugins import get_strategy, registry  # the registry sits above the strategies

    name = strategy_name(strategy)
    cls = get_strategy(name)
    built = []
    for factory in specs:
        spec = factory()
        if cls.accepts(spec.distribution.policy):
            return spec
        built.append(spec)
    policies = sorted({type(s.distribution.policy).__name__ for s in built})
    fitting = sorted(n for n, entry in registry().strategies.items()
                     if any(entry.cls.accepts(s.distribution.policy) for s in built))
    raise SpecError(
        f"{model} has no spec for the {name!r} strategy: its specs store rows as {', '.join(policies)}, "
        f"which {name!r} does not accept; use one of the strategies that do ({', '.join(fitting)}) "
        "or pass a spec of your own"
    )
