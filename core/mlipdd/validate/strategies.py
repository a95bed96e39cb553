"""What validation needs to know per strategy, read from the strategy's class (NOTE [a
strategy is self-contained] in mlipdd.strategy.base): its registered name, the preset a
model without a spec starts from, and whether every rank holds the whole system. A
strategy without a preset is validated from the model's own spec (or the one passed in)."""

from __future__ import annotations

from mlipdd.data import InputError
from mlipdd.plugins import get_preset, get_strategy
from mlipdd.strategy.fitting import strategy_name as _registered_name


def strategy_name(strategy) -> str:
    """``StrategyKind.SHARDED`` or ``"sharded"`` -> ``"sharded"``; a name no strategy is
    registered under (built-in or a plugin's) is an input error listing the known ones."""
    name = _registered_name(strategy)
    try:
        get_strategy(name)
    except LookupError as exc:
        raise InputError(str(exc).strip("'\"")) from None
    return name


def strategy_preset(name: str):
    """``(preset name, spec)`` a plain model starts from under strategy ``name``, or None."""
    preset = get_strategy(name).preset
    return None if preset is None else (preset, get_preset(preset))


def whole_system(name: str) -> bool:
    """Whether strategy ``name`` gives every rank the whole system by design: its validation
    checks that each rank owns a strict part of it instead of counting what it sees."""
    return get_strategy(name).whole_system
