"""What a model says of its own tensors, under either ShardTensor dispatch.

`local` and `as_atom_rows` are the public forms: a model calls them on what its forward was
handed, and the tensor's type says which dispatch runs (the Python-level `ShardTensor` of
`mlipdd.shard.tensor` or the aten-level one of `mlipdd.shard.aten`). They live here, not in
`tensor.py`, so that the hot path there never imports the aten package.
"""

from __future__ import annotations

import torch

from mlipdd.shard.aten import AtenRefusal, to_local
from mlipdd.shard.aten import ShardTensor as AtenShardTensor
from mlipdd.shard.aten.tensor import declared_atom_rows
from mlipdd.shard.placement import Rows
from mlipdd.shard.tensor import ShardTensor
from mlipdd.shard.tensor import local as _plain_rows


def local(t):
    """The plain tensor behind ``t`` (same data, same autograd history): under the aten
    dispatch this rank's local rows (`mlipdd.shard.aten.to_local`); ``t`` if plain."""
    if isinstance(t, AtenShardTensor):
        return to_local(t)
    return _plain_rows(t)


def as_atom_rows(t: torch.Tensor, like: torch.Tensor, ghosts_current: bool = True, index: bool = False) -> torch.Tensor:
    """Declare ``t`` (a plain tensor with one row per atom of ``like``, along dim 0) as atom
    rows of ``like``'s forward; ``ghosts_current=False``: its ghost rows are not their
    owners' values (a padded neighbour table built from this rank's edges, NOTE
    [placements]). ``index``: its values are this rank's atom row numbers (a neighbour
    table; the aten dispatch reads rows by it). ``t`` itself when ``like`` is not
    distributed (one process). Under the aten dispatch: NOTE [declared rows]."""
    if isinstance(like, AtenShardTensor):
        return declared_atom_rows(t, like, ghosts_current, index)
    if not isinstance(like, ShardTensor) or like._meta.layout.is_replicated():
        return t
    return ShardTensor.wrap(local(t), like._meta, Rows("atoms", stale=not ghosts_current))


def is_distributed(t) -> bool:
    """Whether ``t`` belongs to a distributed forward (a ShardTensor of either dispatch)."""
    return isinstance(t, (AtenShardTensor, ShardTensor))


def process_group(t):
    """The process group of the forward whose rows ``t`` holds (either dispatch): what a step
    with collectives of its own runs them on. None is the default group, and what a plain
    tensor gives: ask `is_distributed` whether there are ranks at all."""
    if isinstance(t, AtenShardTensor):
        return t._ctx.group
    if isinstance(t, ShardTensor):
        return t._meta.group
    return None


def call_adapted(adapter, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` for a step no per-op rule can see into (one with collectives
    of its own, as PME's distributed mesh; a kernel), run as ``adapter`` says (an
    `mlipdd.spec.OpAdapter`, keyed by argument and output position: ``SliceOwned`` /
    ``GatherInputs`` / ``GatherInputsFull`` in, ``AllReduceSum`` / ``ScatterOutputs`` /
    ``SliceOutputsOwned`` out). Under the aten dispatch ``fn`` gets this rank's plain
    tensors, runs with the dispatch's modes off (forward and backward: its factories stay
    plain, its collectives see plain tensors) and is one autograd node whose ends say what
    the values and gradients mean (NOTE [aten op adapters]). ``fn(*args, **kwargs)`` itself
    when no argument is distributed (one process)."""
    from mlipdd.shard.aten.adapters import call_adapted as adapted

    found = [a for a in (*args, *kwargs.values()) if isinstance(a, (AtenShardTensor, ShardTensor))]
    if not found:
        return fn(*args, **kwargs)
    if not isinstance(found[0], AtenShardTensor):
        raise AtenRefusal(f"call_adapted({adapter.qualified_name}) runs under the aten dispatch only; Fix: under the "
                          "torch-function dispatch declare the step as a torch.library custom op with its OpAdapter "
                          "in the spec's custom_ops, or run with dispatch='aten'")
    return adapted(adapter, fn, found[0]._ctx, args, kwargs)
