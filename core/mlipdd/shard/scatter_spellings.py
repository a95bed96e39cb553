"""Other ways of writing a sum into atom rows: ``index_put_(..., accumulate=True)``,
``scatter_reduce(..., "mean")`` and a sparse adjacency matrix product.

None is spelled ``index_add``/``scatter_add``, so the halo and sharded scatter rules
never saw them: under halo storage an accumulating ``index_put_`` into atom rows left
the ghost partials with the ghosts (forces off by 3e-2 in a plain MPNN), and a mean
aggregation was refused. Each is rewritten into the spelling the rules handle, and
dispatched again:

* ``x.index_put_((index,), values, accumulate=True)`` is ``x.index_add_(0, index, values)``
  (also out of place, and through ``torch.index_put``);
* ``scatter_reduce(0, index, src, "mean")`` (or ``index_reduce``) into atom rows, and
  ``"sum"`` with ``include_self=False``, are two scatter-adds (of ``src`` and of ones) and an
  elementwise division or choice;
* ``torch.sparse.mm(A, h)`` with ``A`` a sparse atoms x atoms matrix is ``h`` read at
  ``A``'s columns and summed into its rows (under halo storage, where the sparse kernel
  left the ghost rows short of other ranks' partials: forces off 3e-5 when a later layer
  reads them; refused under sharded storage, whose remote columns do not fit ``A``).

``torch.bincount`` is left alone on purpose: on the edge list it usually builds a
rank's own index structure (counts, then ``cumsum`` offsets into a padded neighbour
matrix, as the aimnet2 plugin does), where the local count is the right one. A degree
used as physics (a mean over neighbours) is written ``index_add`` of ones, which the
scatter rules complete over ranks.
"""

from __future__ import annotations

import torch

from mlipdd.shard.layouts import Layout
from mlipdd.shard.placement import EDGES, rows_kind
from mlipdd.shard.registry import register
from mlipdd.shard.tensor import ShardMeta, ShardTensor, poison

_INDEX_PUTS = (torch.Tensor.index_put_, torch.Tensor.index_put, torch.index_put)


def _row_storage(meta: ShardMeta) -> bool:
    return meta.layout.is_halo() or meta.layout.is_sharded()


def _accumulating_put(func, meta, args, kwargs) -> bool:
    if not _row_storage(meta):
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
_INDEX_REDUCES = (torch.Tensor.index_reduce, torch.Tensor.index_reduce_, torch.index_reduce)


def _reduce_args(args, kwargs):
    """(target, dim, index, values, reduce, include_self) of a scatter_reduce/index_reduce."""
    names = ("input", "dim", "index", "src", "reduce")
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    values.setdefault("src", kwargs.get("source"))  # index_reduce's name for it
    return (values.get("input"), values.get("dim"), values.get("index"), values["src"], values.get("reduce"),
            kwargs.get("include_self", True))


def _into_atom_rows(func, meta, args, kwargs) -> bool:
    """A scatter_reduce/index_reduce along dim 0 into atom rows, where scatters cross ranks."""
    layout = meta.layout
    if not _row_storage(meta) or not (layout.correct_scatters if layout.is_halo() else layout.route_scatters):
        return False  # a local scatter (the spec says so): torch's own
    target, dim = _reduce_args(args, kwargs)[:2]
    if target is None or dim is None or target.dim() == 0:
        return False
    dim = dim + target.dim() if dim < 0 else dim
    return dim == 0 and rows_kind(target, meta) == "node"


def _reduces_by_sums(func, meta, args, kwargs) -> bool:
    """A mean (or a sum without the target's own values) into atom rows."""
    reduce, include_self = _reduce_args(args, kwargs)[4:]
    return (reduce == "mean" or (reduce == "sum" and not include_self)) and _into_atom_rows(func, meta, args, kwargs)


@register(Layout, *_SCATTER_REDUCES, *_INDEX_REDUCES, name="scatter_mean_as_sums", predicate=_reduces_by_sums,
          doc="scatter_reduce/index_reduce 'mean' (or 'sum' without self) into atom rows: two scatter-adds, a division.")
def scatter_mean_as_sums(func, meta, args, kwargs):
    target, _, index, src, reduce, include_self = _reduce_args(args, kwargs)
    if func in _INDEX_REDUCES:
        sums = torch.zeros_like(target).index_add(0, index, src)
        counts = torch.zeros_like(target).index_add(0, index, torch.ones_like(src))
    else:
        sums = torch.zeros_like(target).scatter_add(0, index, src)
        counts = torch.zeros_like(target).scatter_add(0, index, torch.ones_like(src))
    if reduce == "mean":
        out = (target + sums) / (counts + 1) if include_self else torch.where(counts > 0, sums / counts.clamp(min=1), target)
    else:
        out = torch.where(counts > 0, sums, target)
    if func in (torch.Tensor.scatter_reduce_, torch.Tensor.index_reduce_):
        poison(target, func.__name__)  # in place, answered out of place: rebind (NOTE [dropped rebind])
    return out


@register(Layout, *_INDEX_REDUCES, name="index_reduce_refused", predicate=_into_atom_rows,
          doc="index_reduce 'amax'/'amin'/'prod' into atom rows: refused with the fix.")
def index_reduce_refused(func, meta, args, kwargs):
    reduce = _reduce_args(args, kwargs)[4]
    raise NotImplementedError(
        f"index_reduce(reduce={reduce!r}) into atom rows under domain decomposition: a ghost row's "
        "partial result would not reach its owner (only sums and means have a cross-rank rule). "
        "Use index_add (a sum) or index_reduce(..., 'mean'), or give the model an OpAdapter"
    )


# ---- a sparse adjacency times atom rows -----------------------------------------------------
_SPARSE_PRODUCTS = (torch.sparse.mm, torch.mm, torch.Tensor.mm, torch.matmul, torch.Tensor.matmul,
                    torch.Tensor.__matmul__)


def _adjacency_product(func, meta, args, kwargs) -> bool:
    """``A @ h`` with ``A`` a sparse (atoms x atoms) COO matrix: a message sum in matrix form."""
    if len(args) != 2 or kwargs or not _row_storage(meta):
        return False
    adjacency, rows = args
    return (isinstance(adjacency, torch.Tensor) and adjacency.is_sparse and adjacency.dim() == 2
            and isinstance(rows, torch.Tensor) and rows.dim() in (1, 2)
            and rows_kind(adjacency, meta) == "node" and rows_kind(rows, meta) == "node")


@register(Layout, *_SPARSE_PRODUCTS, name="adjacency_as_scatter", predicate=_adjacency_product,
          doc="A sparse atoms x atoms matrix times atom rows: gather by column, index_add by row.")
def adjacency_as_scatter(func, meta, args, kwargs):
    """Row ``i`` of ``A @ h`` sums ``A[i, j] * h[j]``: the sum into row ``i`` goes through
    the scatter rule (ghost partials to their owners), which a sparse kernel bypasses."""
    adjacency, rows = args
    if meta.layout.is_sharded():
        raise NotImplementedError(
            "a sparse atoms x atoms matrix under sharded storage: a rank holds only its own atoms, "
            "so the columns of remote neighbours do not fit the matrix (torch does not check, and "
            "the product would be wrong). Write the product as a message sum, "
            "torch.zeros_like(h).index_add(0, receiver, weight[:, None] * h[sender]), or run with "
            "DomainConfig(strategy='halo')"
        )
    adjacency = adjacency.coalesce()  # values() carries the gradient only when coalesced
    # each stored entry comes from this rank's own edges: edge rows, counted once over ranks
    receiver, sender = (ShardTensor.wrap(i, meta, EDGES) for i in adjacency.indices())
    weights = adjacency.values()
    gathered = rows[sender]
    messages = gathered * (weights if gathered.dim() == 1 else weights.unsqueeze(1))
    return torch.zeros_like(rows).index_add(0, receiver, messages)
