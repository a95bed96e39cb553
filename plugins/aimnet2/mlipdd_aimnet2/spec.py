"""The specs AIMNet2 runs under: sharded storage (default) and halo storage.

Sharded storage fits aimnet's layout: every read of a neighbour's row is an
``index_select`` through the receiver-major matrix followed by a contraction over the
slot dimension (no scatter into node rows), so there is no ghost copy to keep fresh;
under sharded storage each such read is routed to the owner. See the plugin README for
the measured comparison with halo storage.
"""

from __future__ import annotations

import functools

from mlipdd.spec import (
    DistributionSpec,
    HaloStoragePolicy,
    MLIPSpec,
    OutputKind,
    ShardedStoragePolicy,
)
from mlipdd.strategy.fitting import fitting_spec

AIMNET2_OUTPUTS = {
    "energy": OutputKind.PER_GRAPH,
    "forces": OutputKind.PER_NODE,
    "stress": OutputKind.PER_GRAPH,
    "charges": OutputKind.PER_NODE,
}


@functools.cache
def aimnet2_sharded_spec() -> MLIPSpec:
    """Owned rows only; stress is a per-rank partial of the strain derivative, summed."""
    from mlipdd_aimnet2.adapters import aimnet2_helpers

    return MLIPSpec(
        distribution=DistributionSpec(ShardedStoragePolicy(), third_party_helpers=aimnet2_helpers()),
        output_kinds=AIMNET2_OUTPUTS,
        all_reduce_outputs=frozenset({"stress"}),
        name="aimnet2_sharded",
    )


@functools.cache
def aimnet2_halo_spec() -> MLIPSpec:
    """Owned + ghost rows; the convolution's ghost rows are refreshed from their owners."""
    from mlipdd_aimnet2.adapters import aimnet2_helpers

    return MLIPSpec(
        distribution=DistributionSpec(HaloStoragePolicy(), third_party_helpers=aimnet2_helpers(halo=True)),
        output_kinds=AIMNET2_OUTPUTS,
        all_reduce_outputs=frozenset({"stress"}),
        name="aimnet2_halo",
    )


def aimnet2_spec(strategy=None) -> MLIPSpec:
    """The spec for the strategy named ``strategy`` (None: sharded, the one AIMNet2 fits
    best): the first of sharded and halo storage it accepts."""
    return fitting_spec(strategy, (aimnet2_sharded_spec, aimnet2_halo_spec), "AIMNet2")
