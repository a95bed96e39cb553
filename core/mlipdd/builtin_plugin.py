"""The plugin that ships inside the core: the Lennard-Jones reference model, the
core's presets and the built-in decomposition strategies. It registers through the public hooks like any third-party plugin.

Imports happen inside the hooks so that importing the plugin system stays cheap and a
core module that is not there (yet) costs that one registration, not the whole plugin.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from mlipdd.hookspecs import (
    RegisterModel,
    RegisterPreset,
    RegisterSpecModule,
    RegisterStrategy,
    hookimpl,
)

BUILTIN_PRESETS = ("SPEC_MPNN_HALO", "SPEC_LJ_HALO")


def _optional_core_module(path: str) -> ModuleType | None:
    """Import a core module, or ``None`` if that module itself does not exist.

    An error *inside* an existing module still propagates: that is a bug to see.
    """
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name == path:
            return None
        raise


@hookimpl
def mlipdd_register_models(register: RegisterModel) -> None:
    lj = _optional_core_module("mlipdd.models.lj")
    if lj is not None:
        register(
            "lj",
            lj.LennardJones,
            "Lennard-Jones pair potential: the reference model for tests and the demo",
        )


@hookimpl
def mlipdd_register_presets(register: RegisterPreset) -> None:
    presets = _optional_core_module("mlipdd.spec.presets")
    if presets is None:
        return
    for name in BUILTIN_PRESETS:
        if hasattr(presets, name):
            register(name, getattr(presets, name))


@hookimpl
def mlipdd_register_spec_modules(register: RegisterSpecModule) -> None:
    register("mlipdd.spec")


@hookimpl
def mlipdd_register_strategies(register: RegisterStrategy) -> None:
    from mlipdd.strategy import GraphPartitionStrategy, HaloStrategy, ShardedStrategy, StrategyKind

    register(StrategyKind.HALO.value, HaloStrategy,
             "spatial subdomains + ghost shell (short-range MPNNs, pair potentials)")
    register(StrategyKind.SHARDED.value, ShardedStrategy,
             "spatial ownership, owned rows only; reads of remote rows routed to their owners")
    register(StrategyKind.GRAPH_PARTITION.value, GraphPartitionStrategy,
             "replicated positions, node partition (models that build their own graph)")
