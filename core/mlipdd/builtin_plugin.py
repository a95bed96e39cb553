"""The plugin that ships inside the core: the Lennard-Jones reference model, the
core's presets and the built-in decomposition strategies. It registers through the public hooks like any third-party plugin.

Imports happen inside the hooks so that importing the plugin system stays cheap.
"""

from __future__ import annotations

from mlipdd.hookspecs import (
    RegisterModel,
    RegisterPreset,
    RegisterSpecModule,
    RegisterStrategy,
    hookimpl,
)


@hookimpl
def mlipdd_register_models(register: RegisterModel) -> None:
    from mlipdd.models.lj import LennardJones

    register("lj", LennardJones, "Lennard-Jones pair potential: the reference model for tests and the demo")


@hookimpl
def mlipdd_register_presets(register: RegisterPreset) -> None:
    """Every preset of `mlipdd.spec.presets`: ``get_preset(name)`` is the one lookup."""
    from mlipdd.spec.presets import PRESETS

    for name, spec in PRESETS.items():
        register(name, spec)


@hookimpl
def mlipdd_register_spec_modules(register: RegisterSpecModule) -> None:
    register("mlipdd.spec")


@hookimpl
def mlipdd_register_strategies(register: RegisterStrategy) -> None:
    from mlipdd.strategy import GraphPartitionStrategy, HaloStrategy, ShardedStrategy

    register(HaloStrategy.name, HaloStrategy,
             "spatial subdomains + ghost shell (short-range MPNNs, pair potentials)")
    register(ShardedStrategy.name, ShardedStrategy,
             "spatial ownership, owned rows only; reads of remote rows routed to their owners")
    register(GraphPartitionStrategy.name, GraphPartitionStrategy,
             "replicated positions, node partition (models that build their own graph)")
