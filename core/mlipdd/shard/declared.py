"""What a model says of its own tensors: `local` and `as_atom_rows`, the public forms.

A model calls them on what its forward was handed; on plain tensors (one process, or one
rank's plain rows) they are the identity. They live here, not in `mlipdd.shard.aten`, so
that a model imports them from `mlipdd.shard` whatever it runs under.
"""

from __future__ import annotations

import torch

from mlipdd.shard.aten import ShardTensor, to_local
from mlipdd.shard.aten.tensor import declared_atom_rows


def local(t):
    """The plain tensor behind ``t`` (same data, same autograd history): this rank's local
    rows (`mlipdd.shard.aten.to_local`); ``t`` if plain."""
    return to_local(t) if isinstance(t, ShardTensor) else t


def as_atom_rows(t: torch.Tensor, like: torch.Tensor, ghosts_current: bool = True, index: bool = False) -> torch.Tensor:
    """Declare ``t`` (a plain tensor with one row per atom of ``like``, along dim 0) as atom
    rows of ``like``'s forward; ``ghosts_current=False``: its ghost rows are not their
    owners' values (a padded neighbour table built from this rank's edges). ``index``: its
    values are this rank's atom row numbers (a neighbour table; the dispatch reads rows by
    it). ``t`` itself when ``like`` is not distributed (one process). NOTE [declared rows]
    in `mlipdd.shard.aten.tensor`."""
    if isinstance(like, ShardTensor):
        return declared_atom_rows(t, like, ghosts_current, index)
    return t


def is_distributed(t) -> bool:
    """Whether ``t`` belongs to a distributed forward (a ShardTensor)."""
    return isinstance(t, ShardTensor)


def process_group(t):
    """The process group of the forward whose rows ``t`` holds: what a step with collectives of
    its own runs them on. None is the default group, and what a plain tensor gives: ask
    `is_distributed` whether there are ranks at all."""
    return t._ctx.group if isinstance(t, ShardTensor) else None


def call_adapted(adapter, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` for a step no per-op rule can see into (one with collectives
    of its own, as PME's distributed mesh; a kernel), run as ``adapter`` says (an
    `mlipdd.spec.OpAdapter`, keyed by argument and output position: ``SliceOwned`` /
    ``GatherInputs`` / ``GatherInputsFull`` in, ``AllReduceSum`` / ``ScatterOutputs`` /
    ``SliceOutputsOwned`` out). ``fn`` gets this rank's plain tensors, runs with the
    dispatch's modes off (forward and backward: its factories stay plain, its collectives see
    plain tensors) and is one autograd node whose ends say what the values and gradients mean
    (NOTE [aten op adapters]). ``fn(*args, **kwargs)`` itself when no argument is distributed
    (one process)."""
    from mlipdd.shard.aten.adapters import call_adapted as adapted

    found = [a for a in (*args, *kwargs.values()) if isinstance(a, ShardTensor)]
    if not found:
        return fn(*args, **kwargs)
    return adapted(adapter, fn, found[0]._ctx, args, kwargs)
