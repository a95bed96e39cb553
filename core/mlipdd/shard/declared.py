"""What a model says of its own tensors: `local` and `as_atom_rows`, the public forms.

A model calls them on what its forward was handed; on plain tensors (one process, or one
rank's plain rows) they are the identity. They live here, not in `mlipdd.shard.aten`, so
that a model imports them from `mlipdd.shard` whatever it runs under.
"""

from __future__ import annotations

import torch

from mlipdd.shard.aten import EDGES, AtenRefusal, Rows, ShardTensor, to_local
from mlipdd.shard.aten.factories import mark_rank_local
from mlipdd.shard.aten.tensor import declared_atom_rows
from mlipdd.shard.internal import internal_scope


def local(t):
    """The plain tensor behind ``t`` (same data, same autograd history): this rank's local
    rows (`mlipdd.shard.aten.to_local`); ``t`` if plain. Atom rows are every row this rank's
    edge index names: ``[owned | ghost]`` under halo storage, ``[owned | request table]``
    under sharded storage (NOTE [local rows under sharded storage])."""
    if not isinstance(t, ShardTensor):
        return t
    if not isinstance(t._place, Rows):
        return to_local(t)
    out = to_local(_with_request_table(t) if t._ctx.reads is not None and t._place.is_atoms() else t)
    t._ctx.local_rows_taken = True  # NOTE [rank-local values]: this rank's rows, marked
    mark_rank_local(out)
    return out


# NOTE [local rows under sharded storage]
# Under sharded storage a rank stores its owned rows only, and its edge index addresses
# ``[owned | request table]`` (NOTE [aten sharded storage]): a plain read of owned rows by
# the edge index would stop at the first remote sender (torch's bare IndexError). So
# ``local()`` of atom rows hands out what the edge index names: the owned rows and the
# request table's rows, fetched from their owners. It is the sharded read rule itself, a
# read by the index ``0 .. n_owned + n_request - 1`` (one all_to_all), so the gradient that
# reaches a request-table row goes back to its owner through the same rules (the read's
# adjoint delivers it; double backward too). `as_atom_rows` takes such rows back (the owned
# ones; a request-table row is a copy of its owner, or holds nothing of meaning). Rows
# whose VALUES are atom row numbers (a declared neighbour table) are refused: the owners'
# numbers of their rows are not this rank's numbers of the request table.
def _with_request_table(t: ShardTensor) -> ShardTensor:
    place, ctx = t._place, t._ctx
    if place.values == "atoms" or place.group != 1:
        what = "whose values are atom row numbers (an index table)" if place.values == "atoms" else \
            f"merged with {place.group} entries per row"
        raise AtenRefusal(
            f"mlipdd.shard.local() of atom rows {what} (from `{t._origin}`) under sharded storage: local() hands "
            "out [owned | request table] rows fetched from their owners, and these cannot be fetched exactly. "
            "Fix: take local() of the edge index and of the atom rows it reads (positions, features) and build "
            "the table from them, or run with strategy='halo'")
    with internal_scope():  # a plain index (NOTE [internal factories])
        rows = torch.arange(ctx.reads.n_padded, device=t.device)
    index = ShardTensor(rows, Rows(0, EDGES, values="atoms"), ctx, "local() rows")
    return t.index_select(place.dim, index)


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
