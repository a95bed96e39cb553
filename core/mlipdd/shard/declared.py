"""What a model says of its own tensors, under either ShardTensor dispatch.

`local` and `as_atom_rows` are the public forms: a model calls them on what its forward was
handed, and the tensor's type says which dispatch runs (the Python-level `ShardTensor` of
`mlipdd.shard.tensor` or the aten-level one of `mlipdd.shard.aten`). They live here, not in
`tensor.py`, so that the hot path there never imports the aten package.
"""

from __future__ import annotations

import torch

from mlipdd.shard.aten import ShardTensor as AtenShardTensor
from mlipdd.shard.aten import to_local
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
