"""Other ways of writing a sum into rows: ``index_put_(..., accumulate=True)`` and
``torch.bincount``.

Both are scatter-adds, but not spelled as ``index_add``/``scatter_add``, so the halo and
sharded scatter rules never saw them. Under halo storage an accumulating ``index_put_``
into atom rows left the ghost partials with the ghosts (forces off by 3e-2 in a plain
MPNN), and an out-degree ``torch.bincount(sender, minlength=n_atoms)`` missed the edges
that live on other ranks (forces off by 40 %). Here each is rewritten into the spelling
the rules handle, and dispatched again:

* ``x.index_put_((index,), values, accumulate=True)`` is ``x.index_add_(0, index, values)``
  (also out of place, and through ``torch.index_put``);
* ``scatter_reduce(0, index, src, "mean")`` into atom rows (a mean aggregation), and
  ``"sum"`` with ``include_self=False``, are two scatter-adds (of ``src`` and of ones)
  and an elementwise division or choice;
* ``torch.bincount(index, weights, minlength=n)`` with ``n`` the atom rows of this layout
  is a scatter of ones (or ``weights``) into atom rows: an ``index_add`` into
  ``torch.zeros(n)``; any other ``bincount`` of rows is a histogram over all atoms or
  edges: counted rows, a common length (the largest over ranks), summed over ranks, and
  replicated.

The edge list is plain (not a ShardTensor), so ``torch.bincount(receiver, minlength=n)``
never reaches the dispatch: `bincount_scope`, entered around the model call by the halo
and sharded strategies, wraps ``torch.bincount`` for that call only (as the factories are
wrapped, NOTE [patched factories] in `mlipdd.shard.owned_rows`) and sends a plain index
with an atom-row ``minlength`` the same way.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.distributed as dist

from mlipdd.comm import group_size
from mlipdd.shard.exchange import all_reduce_sum
from mlipdd.shard.handlers import _counted_rows
from mlipdd.shard.layouts import Layout
from mlipdd.shard.owned_rows import RowCount
from mlipdd.shard.registry import register
from mlipdd.shard.replicated import replicated
from mlipdd.shard.tensor import ShardMeta, ShardTensor, local, poison

_INDEX_PUTS = (torch.Tensor.index_put_, torch.Tensor.index_put, torch.index_put)


def _on_rows(meta: ShardMeta) -> bool:
    return (meta.layout.is_halo() or meta.layout.is_sharded()) and meta.layout.rows_lead()


def _accumulating_put(func, meta, args, kwargs) -> bool:
    if not _on_rows(meta):
        return False
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    return bool(accumulate) and isinstance(indices, (tuple, list)) and len(indices) == 1 \
        and isinstance(indices[0], torch.Tensor) and indices[0].dim() == 1 \
        and indices[0].dtype in (torch.int64, torch.int32)


@register(Layout, *_INDEX_PUTS, name="index_put_as_index_add", predicate=_accumulating_put,
          doc="index_put(..., accumulate=True) with one index: index_add along dim 0 (dispatched again).")
def index_put_as_index_add(func, meta, args, kwargs):
    target = args[0] if args else kwargs["input"]
    (index,) = args[1] if len(args) > 1 else kwargs["indices"]
    values = args[2] if len(args) > 2 else kwargs["values"]
    if func is torch.Tensor.index_put_:
        return target.index_add_(0, index, values)  # in place: the scatter rules' rebind check
    return target.index_add(0, index, values)


_SCATTER_REDUCES = (torch.Tensor.scatter_reduce, torch.Tensor.scatter_reduce_, torch.scatter_reduce)


def _scatter_reduce_args(args, kwargs):
    names = ("input", "dim", "index", "src", "reduce")
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    return values, kwargs.get("include_self", True)


def _reduces_by_sums(func, meta, args, kwargs) -> bool:
    """A mean (or a sum without the target's own values) scattered into atom rows."""
    layout = meta.layout
    if not _on_rows(meta) or not (layout.correct_scatters if layout.is_halo() else layout.route_scatters):
        return False  # a local scatter (the spec says so): torch's own scatter_reduce
    values, include_self = _scatter_reduce_args(args, kwargs)
    target, dim = values.get("input"), values.get("dim")
    if target is None or dim is None or target.dim() == 0:
        return False
    dim = dim + target.dim() if dim < 0 else dim
    by_sums = values.get("reduce") == "mean" or (values.get("reduce") == "sum" and not include_self)
    return by_sums and dim == 0 and meta.row_kind(target.shape[0]) == "node"


@register(Layout, *_SCATTER_REDUCES, name="scatter_mean_as_sums", predicate=_reduces_by_sums,
          doc="scatter_reduce 'mean' (or 'sum' without self) into atom rows: two scatter-adds, then a division.")
def scatter_mean_as_sums(func, meta, args, kwargs):
    values, include_self = _scatter_reduce_args(args, kwargs)
    target, index, src = values["input"], values["index"], values["src"]
    sums = torch.zeros_like(target).scatter_add(0, index, src)
    counts = torch.zeros_like(target).scatter_add(0, index, torch.ones_like(src))
    if values["reduce"] == "mean":
        out = (target + sums) / (counts + 1) if include_self else torch.where(counts > 0, sums / counts.clamp(min=1), target)
    else:
        out = torch.where(counts > 0, sums, target)
    if func is torch.Tensor.scatter_reduce_:
        poison(target, "scatter_reduce_")  # in place, answered out of place: rebind (NOTE [dropped rebind])
    return out


def _bincount_args(args, kwargs):
    index = args[0] if args else kwargs["input"]
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
    return index, weights, minlength


def _rows_tensor(t) -> bool:
    return isinstance(t, ShardTensor) and not t.meta.layout.is_replicated()


def _bincounts_rows(func, meta, args, kwargs) -> bool:
    """A count into atom rows (any index, e.g. the receivers within the cutoff), or a
    histogram of atom or edge rows."""
    index, weights, minlength = _bincount_args(args, kwargs)
    if not (_on_rows(meta) and meta.system_reductions and (_rows_tensor(index) or _rows_tensor(weights))):
        return False
    return _counts_atom_rows(meta, minlength) or (_rows_tensor(index) and meta.row_kind(index.shape[0]) != "other")


@register(Layout, torch.bincount, name="bincount_rows", predicate=_bincounts_rows,
          doc="torch.bincount into atom rows: an index_add; of atom/edge rows: a histogram over ranks.")
def bincount_rows(func, meta: ShardMeta, args, kwargs):
    index, weights, minlength = _bincount_args(args, kwargs)
    if _counts_atom_rows(meta, minlength):
        return _scatter_count(meta, index, weights, minlength)
    return _histogram(meta, local(index), None if weights is None else local(weights), int(minlength))


def _scatter_count(meta: ShardMeta, index, weights, minlength) -> ShardTensor:
    """The count (or weight sum) per atom row, through the layout's scatter rule."""
    with torch._C.DisableTorchFunctionSubclass():
        values = torch.ones(index.shape[0], dtype=torch.int64, device=index.device) if weights is None else weights
        target = torch.zeros(int(minlength), dtype=values.dtype, device=index.device)
    return ShardTensor.wrap(target, meta).index_add(0, index, values)


def _counts_atom_rows(meta: ShardMeta, minlength) -> bool:
    """``minlength`` is this layout's atom rows: counted by the layout (sharded storage)
    or, under halo storage, the padded row count (as the halo scatter rule decides)."""
    if meta.layout.is_sharded():
        return isinstance(minlength, RowCount)
    return int(minlength) == meta.n_padded


def _histogram(meta: ShardMeta, index: torch.Tensor, weights, minlength: int):
    rows = _counted_rows(meta, index.shape[0], "bincount")
    index = index[rows]
    weights = None if weights is None else weights[rows]
    length = max(minlength, int(index.max()) + 1 if index.numel() else 0)
    if group_size(meta.group) > 1:  # one length on every rank: the largest
        agreed = torch.tensor([length], dtype=torch.int64, device=index.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=meta.group)
        length = int(agreed.item())
    with torch._C.DisableTorchFunctionSubclass():
        counts = torch.bincount(index, weights, minlength=length)
    return replicated(all_reduce_sum(counts, meta.group), meta)


# ---- a plain index (the edge list) inside the model call ---------------------------------
_ACTIVE: ContextVar[ShardMeta | None] = ContextVar("mlipdd_bincount", default=None)
_LOCK = threading.Lock()
_DEPTH = 0
_ORIGINAL = torch.bincount


@functools.wraps(_ORIGINAL)
def _bincount(input, weights=None, minlength=0):
    meta = _ACTIVE.get()
    if (meta is None or isinstance(input, ShardTensor) or isinstance(weights, ShardTensor)
            or not meta.system_reductions or not _counts_atom_rows(meta, minlength)):
        return _ORIGINAL(input, weights, minlength=minlength)
    return _scatter_count(meta, input, weights, minlength)


@contextlib.contextmanager
def bincount_scope(meta: ShardMeta) -> Iterator[None]:
    """Around one rank's model call: ``torch.bincount`` of a plain index into atom rows
    goes through the layout's scatter rule (see the module docstring)."""
    global _DEPTH
    token = _ACTIVE.set(meta)
    with _LOCK:
        _DEPTH += 1
        torch.bincount = _bincount
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                torch.bincount = _ORIGINAL
        _ACTIVE.reset(token)
