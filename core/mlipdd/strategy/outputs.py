"""The part of output consolidation every strategy shares."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlipdd.shard import all_reduce_sum, local


def consolidate_outputs(outputs: dict, spec, group, per_atom: Callable | None = None) -> dict:
    """Detach every output, sum the spec's per-rank partials (``all_reduce_outputs``) and
    hand each other tensor to ``per_atom(name, value)`` (the strategy's row rule)."""
    result = {}
    for name, value in outputs.items():
        if not torch.is_tensor(value):
            result[name] = value
            continue
        value = local(value).detach()
        if name in spec.all_reduce_outputs:
            value = all_reduce_sum(value, group)
        elif per_atom is not None:
            value = per_atom(name, value)
        result[name] = value
    return result
