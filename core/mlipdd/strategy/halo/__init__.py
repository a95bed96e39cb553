"""The halo strategy, in one package (``DomainConfig(strategy="halo")``).

* storage policy: `mlipdd.spec.HaloStoragePolicy` (what a model's spec asks for);
* planner (`planner.py`): ownership by cut planes, migration, the halo plan, the
  local neighbour list over ``[owned | ghost]``;
* strategy (`strategy.py`): the model batch (aten ShardTensor rows, `mlipdd.shard.aten`),
  consolidation by placement and reporting (`Strategy.report`).
"""

from mlipdd.strategy.halo.planner import (
    HaloPlanner,
    HaloState,
    check_domain_inputs,
    exchange_counts,
    local_neighbors,
    wrap_positions,
    wrapped_fractional,
)
from mlipdd.strategy.halo.strategy import HaloStrategy, SpatialStrategy, model_inputs

__all__ = [
    "HaloPlanner",
    "HaloState",
    "HaloStrategy",
    "SpatialStrategy",
    "check_domain_inputs",
    "exchange_counts",
    "local_neighbors",
    "model_inputs",
    "wrap_positions",
    "wrapped_fractional",
]
