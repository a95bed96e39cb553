"""The part of output consolidation every strategy shares.

NOTE [output kinds drive consolidation]
The spec's ``output_kinds`` decide what happens to each output: a per-rank partial
named in ``all_reduce_outputs`` is summed over ranks; a PER_GRAPH or GLOBAL output is
replicated already (the model's per-system sums were completed by the dispatch) and
is kept as it is, whatever its row count; a PER_NODE output goes through the
strategy's row rule (ghost partials to owners, owned rows kept). An output the spec
does not declare (UNKNOWN) goes through the row rule too, which keeps the tensors
whose rows are this rank's atoms and passes anything else through. These are the rules
for PLAIN outputs (the compiled calls' partials); the eager forward's ShardTensor outputs
are consolidated by placement (`SpatialStrategy.consolidate`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlipdd.shard.exchange import all_reduce_sum
from mlipdd.spec.kinds import OutputKind


def consolidate_outputs(outputs: dict, spec, group, per_atom: Callable | None = None) -> dict:
    """Detach every output, sum the spec's per-rank partials (``all_reduce_outputs``),
    keep replicated kinds and hand the rest to ``per_atom(name, value)`` (the strategy's
    row rule); see NOTE [output kinds drive consolidation]."""
    result = {}
    for name, value in outputs.items():
        if not torch.is_tensor(value):
            result[name] = value
            continue
        value = value.detach()
        kind = spec.output_kinds.get(name, OutputKind.UNKNOWN)
        if name in spec.all_reduce_outputs:
            value = all_reduce_sum(value, group)
        elif kind.is_per_graph() or kind.is_global():
            pass  # replicated on every rank
        elif per_atom is not None:
            value = per_atom(name, value)
        result[name] = value
    return result
