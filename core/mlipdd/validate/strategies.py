"""What validation needs to know per strategy: its name, the spec it starts from when
the model declares none, and the preset whose policy fits it (for the auto-fix rule and
the translator). A strategy without an entry here is validated from the model's own
spec (or the one passed in)."""

from __future__ import annotations

from mlipdd.data import InputError
from mlipdd.plugins import get_strategy
from mlipdd.spec.presets import SPEC_MPNN_GP, SPEC_MPNN_HALO, SPEC_MPNN_SHARDED

# the preset a plain model runs under, per strategy (its policy is the one that fits)
STRATEGY_PRESETS = {
    "halo": ("SPEC_MPNN_HALO", SPEC_MPNN_HALO),
    "sharded": ("SPEC_MPNN_SHARDED", SPEC_MPNN_SHARDED),
    "graph_partition": ("SPEC_MPNN_GP", SPEC_MPNN_GP),
}

# strategies that give every rank the whole system by design: their validation checks that
# each rank owns a strict part of it instead of counting what it sees
WHOLE_SYSTEM_STRATEGIES = frozenset({"graph_partition"})


def strategy_name(strategy) -> str:
    """``StrategyKind.SHARDED`` or ``"sharded"`` -> ``"sharded"``; a name no strategy is
    registered under (built-in or a plugin's) is an input error listing the known ones."""
    name = str(getattr(strategy, "value", strategy))
    try:
        get_strategy(name)
    except LookupError as exc:
        raise InputError(str(exc).strip("'\"")) from None
    return name


def strategy_preset(name: str):
    """``(preset name, spec)`` a plain model starts from under strategy ``name``, or None."""
    return STRATEGY_PRESETS.get(name)
