"""The specs UMA runs under: `SPEC_UMA_HALO` (spatial halo) and a graph-partition spec.

The adapters name fairchem's classes and functions by module path, so building a spec
imports neither fairchem (seconds) nor the replacements: plugin discovery stays fast.
"""

from __future__ import annotations

import functools

from mlipdd.spec import DistributionSpec, HaloStoragePolicy, MLIPSpec, OutputKind
from mlipdd.strategy.fitting import fitting_spec

UMA_OUTPUTS = {
    "energy": OutputKind.PER_GRAPH,
    "forces": OutputKind.PER_NODE,
    "stress": OutputKind.PER_GRAPH,
}


@functools.cache
def uma_halo_spec() -> MLIPSpec:
    """Halo storage + the fairchem adapters of `mlipdd_uma.halo`; stress is a per-rank
    partial (each rank's virial covers its own padded rows) and is summed at the end."""
    from mlipdd_uma.halo import halo_helpers

    return MLIPSpec(
        distribution=DistributionSpec(HaloStoragePolicy(builds_own_graph=True), third_party_helpers=halo_helpers()),
        output_kinds=UMA_OUTPUTS,
        all_reduce_outputs=frozenset({"stress"}),
        name="uma_halo",
    )


def uma_spec(strategy=None) -> MLIPSpec:
    """The spec for the strategy named ``strategy`` (None means halo): the first of halo
    and graph-partition storage it accepts."""
    def graph_partition():
        from mlipdd_uma.graph_partition import uma_graph_partition_spec

        return uma_graph_partition_spec()

    return fitting_spec(strategy, (uma_halo_spec, graph_partition), "UMA")


def __getattr__(name: str):
    if name == "SPEC_UMA_HALO":  # module attribute built on first use
        return uma_halo_spec()
    raise AttributeError(name)
