"""Reductions over atom or edge rows besides the sum: means, extremes, products, and the
refused rest.

A rank holds some of the rows (halo storage: its owned atoms, then ghost copies; sharded
storage: its owned atoms; either: the edges it computes). Left alone, ``x.mean()`` or
``x.max()`` would reduce this rank's rows only (ghost copies included under halo) and
give every rank a different, silently wrong number. Here they reduce the counted rows
(each atom and edge once over all ranks) and combine the partials over ranks, so the
result equals one process's and is replicated (NOTE [whole sums are replicated] in
`mlipdd.shard.handlers` for the sum, whose rules live with each layout's other rules).

Softmax and log-softmax over the atoms, logsumexp, variance, standard deviation and
vector norms over rows are written with those rules. Reductions over rows with no exact
cross-rank form here (products, medians, positions of extremes, matrix norms), and
all-pairs distances of the atoms (``torch.cdist``), raise with the fix instead of
answering. Running sums (``cumsum``) stay local: they
build a rank's own index structures (offsets into its neighbour rows). Reductions
along other dimensions (``vectors.norm(dim=-1)``, per-row means) are per-row
and stay local; so do reductions of integer and boolean rows (NOTE [integer rows stay
local]).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mlipdd.comm import group_size
from mlipdd.shard.exchange import all_reduce_sum
from mlipdd.shard.handlers import _counted_rows, _sum_dims
from mlipdd.shard.layouts import Layout
from mlipdd.shard.placement import placement_of, rows_kind
from mlipdd.shard.propagation import NoRuleError
from mlipdd.shard.registry import register
from mlipdd.shard.replicated import replicated
from mlipdd.shard.tensor import ShardMeta, ShardTensor, local

_MEANS = (torch.mean, torch.Tensor.mean)
_EXTREMES = {torch.amax: "max", torch.Tensor.amax: "max", torch.amin: "min", torch.Tensor.amin: "min",
             torch.max: "max", torch.Tensor.max: "max", torch.min: "min", torch.Tensor.min: "min"}
_REFUSED = (
    torch.prod, torch.Tensor.prod, torch.std, torch.Tensor.std, torch.var, torch.Tensor.var,
    torch.std_mean, torch.var_mean, torch.norm, torch.Tensor.norm, torch.linalg.norm,
    torch.linalg.vector_norm, torch.logsumexp, torch.Tensor.logsumexp, torch.median,
    torch.Tensor.median, torch.nanmedian, torch.Tensor.nanmedian, torch.argmax, torch.Tensor.argmax,
    torch.argmin, torch.Tensor.argmin,
)


def _on_rows(*ops, name: str, predicate):
    """One rule for halo and sharded storage (graph partition holds every row on every
    rank and reduces through its own helpers; the predicate checks `_reduces_over_ranks`)."""
    return register(Layout, *ops, name=name, predicate=predicate)


def _reduces_over_ranks(meta: ShardMeta) -> bool:
    """Halo or sharded storage whose spec completes reductions over ranks."""
    return (meta.layout.is_halo() or meta.layout.is_sharded()) and meta.system_reductions


def _rows_reduced(func, meta: ShardMeta, args, kwargs) -> bool:
    """``args[0]`` holds floating-point atom or edge rows and the call reduces over them
    (dim 0 or all). NOTE [integer rows stay local]: an integer or boolean reduction over
    rows sizes this rank's own index structures (``int(counts.max())`` as the width of a
    padded neighbour matrix, often skipped when the rank has no rows); made collective, a
    rank without rows would skip the collective the others enter. (Integer sums over rows
    were completed over ranks before these rules and still are: counts of atoms.)"""
    x = args[0] if args else kwargs.get("input")
    if not (_reduces_over_ranks(meta) and isinstance(x, ShardTensor) and x.dim() > 0 and x.is_floating_point()):
        return False
    if rows_kind(x, meta) == "other":
        return False
    second = args[1] if len(args) > 1 else kwargs.get("other")
    if isinstance(second, torch.Tensor):  # torch.max(a, b) and the like: elementwise
        return False
    dims = _reduced_dims(func, args, kwargs)
    return dims is None or 0 in dims


_NORMS = (torch.norm, torch.Tensor.norm, torch.linalg.norm, torch.linalg.vector_norm)


def _reduced_dims(func, args, kwargs):
    """The dims a reduction runs over (None: all); the norms take ``p``/``ord`` before ``dim``."""
    if func not in _NORMS:
        return _sum_dims(args, kwargs)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    return _sum_dims((args[0], dim), {})


# ---- rows elsewhere than along dim 0 ----------------------------------------------------------
_FRONTABLE = (torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean, torch.amax, torch.Tensor.amax,
              torch.amin, torch.Tensor.amin, torch.std, torch.Tensor.std, torch.var, torch.Tensor.var,
              torch.logsumexp, torch.Tensor.logsumexp, torch.max, torch.Tensor.max, torch.min, torch.Tensor.min)


def _rows_elsewhere(func, meta, args, kwargs) -> bool:
    """A whole-tensor reduction, or one over the rows dim, of float rows that are not
    along dim 0 one entry each (transposed, stacked, flattened: NOTE [placements])."""
    x = args[0] if args else None
    if not (_reduces_over_ranks(meta) and isinstance(x, ShardTensor) and x.is_floating_point()):
        return False
    place = placement_of(x)
    if place is None or place.is_opaque() or place.dim is None or place.leads() or set(kwargs) - {"dim"}:
        return False
    if len(args) > 2 or (len(args) == 2 and not isinstance(args[1], (int, tuple, list))):
        return False
    dims = _sum_dims(args, kwargs)
    if func in (torch.max, torch.Tensor.max, torch.min, torch.Tensor.min) and dims is not None:
        return False  # with a dim they also return positions
    return dims is None or (place.dim in dims and place.group == 1)


@_on_rows(*_FRONTABLE, name="rows_to_front", predicate=_rows_elsewhere)
def rows_to_front(func, meta: ShardMeta, args, kwargs):
    """The same reduction of the tensor with its rows moved to dim 0 (then a row rule)."""
    x, place = args[0], placement_of(args[0])
    y = local(x).movedim(place.dim, 0)
    dims = _sum_dims(args, kwargs)
    if dims is None:
        width = place.group * math.prod(y.shape[1:])  # a rank without rows has 0 of them
        rows = ShardTensor.wrap(y.reshape(y.shape[0] // place.group, width), meta, place.moved(0, 1))
        return func(rows)
    moved = tuple(0 if d == place.dim else d + (d < place.dim) for d in dims)
    return func(ShardTensor.wrap(y, meta, place.moved(0)), moved)


# ---- means --------------------------------------------------------------------------------
@_on_rows(*_MEANS, name="row_mean", predicate=_rows_reduced)
def row_mean(func, meta: ShardMeta, args, kwargs):
    """The sum over counted rows on every rank, divided by the number of rows of all ranks."""
    rows = _counted_rows(meta, args[0], "mean")
    x = local(args[0])
    counted = x[rows]
    rest = {k: v for k, v in kwargs.items() if k != "input"}
    with torch._C.DisableTorchFunctionSubclass():
        partial = torch.sum(counted, *args[1:], **rest)
    dims = _sum_dims(args, kwargs)
    per_row = math.prod(x.shape[d] for d in (range(1, x.dim()) if dims is None else dims) if d != 0)
    # one collective for the partial sums and this rank's row count together
    both = all_reduce_sum(torch.cat([partial.reshape(-1), partial.new_tensor([counted.shape[0]])]), meta.group)
    return replicated(both[:-1].reshape(partial.shape) / (both[-1] * per_row), meta)


# ---- extremes -----------------------------------------------------------------------------
def _is_row_extreme(func, meta, args, kwargs) -> bool:
    if func not in _EXTREMES or not _rows_reduced(func, meta, args, kwargs):
        return False
    if func in (torch.max, torch.Tensor.max, torch.min, torch.Tensor.min):
        # the whole-tensor form only: with a dim it also returns row positions, and with
        # a second tensor it is elementwise
        return len(args) == 1 and not kwargs
    return True


@_on_rows(*_EXTREMES, name="row_extreme", predicate=_is_row_extreme)
def row_extreme(func, meta: ShardMeta, args, kwargs):
    """The extreme over counted rows of every rank (a rank without rows adds the identity)."""
    kind = _EXTREMES[func]
    x = local(args[0])
    counted = x[_counted_rows(meta, args[0], kind)]
    if counted.shape[0] == 0:  # e.g. a rank whose subdomain is vacuum
        # joined to the empty rows, not in their place: the partial stays in the autograd
        # graph, so this rank's backward runs the same collectives as the others'
        identity = torch.full((1, *x.shape[1:]), -math.inf if kind == "max" else math.inf, dtype=x.dtype,
                              device=x.device)
        counted = torch.cat([counted, identity])
    with torch._C.DisableTorchFunctionSubclass():
        if func in (torch.max, torch.Tensor.max, torch.min, torch.Tensor.min):
            partial = torch.amax(counted) if kind == "max" else torch.amin(counted)
        else:
            partial = (torch.amax if kind == "max" else torch.amin)(counted, *args[1:], **kwargs)
    return replicated(_AllReduceExtreme.apply(partial, kind, meta.group), meta)


class _AllReduceExtreme(torch.autograd.Function):
    """The max (min) of per-rank partials; the gradient goes to the ranks that hold it,
    shared evenly when several do (as torch.amax shares it between equal values)."""

    @staticmethod
    def forward(ctx, partial, kind, group):
        total = partial.clone()
        if group_size(group) > 1:
            op = dist.ReduceOp.MAX if kind == "max" else dist.ReduceOp.MIN
            dist.all_reduce(total, op=op, group=group)
        ctx.save_for_backward(partial, total)
        ctx.group = group
        return total

    @staticmethod
    def backward(ctx, grad):
        partial, total = ctx.saved_tensors
        holds = (partial == total).to(grad.dtype)
        holders = holds.clone()
        if group_size(ctx.group) > 1:
            dist.all_reduce(holders, group=ctx.group)
        return grad * holds / holders.clamp(min=1), None, None


# ---- contractions over the rows --------------------------------------------------------------
_CONTRACTIONS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.dot, torch.Tensor.dot)


def _is_row_contraction(func, meta, args, kwargs) -> bool:
    """``q @ x`` / ``torch.dot(q, p)`` (1-D rows first) or ``x.T @ y`` (rows along the first
    operand's last dim): a sum over the atoms or edges, as in a dipole ``q @ r``."""
    if len(args) != 2 or kwargs or not _reduces_over_ranks(meta):
        return False
    a, b = args
    if not (isinstance(a, ShardTensor) and isinstance(b, ShardTensor)) or b.dim() == 0 or a.dim() == 0:
        return False
    if a.meta.layout.is_replicated() or b.meta.layout.is_replicated():
        return False
    rows = rows_kind(b, meta)
    if rows == "other" or a.dim() > 2:
        return False
    pa = placement_of(a)
    if a.dim() == 1:
        return pa.leads() and pa.kind == placement_of(b).kind
    # (k, n) @ (n, m): the rows transposed onto the first operand's last dim
    return pa.dim == 1 and pa.group == 1 and pa.kind == placement_of(b).kind


@_on_rows(*_CONTRACTIONS, name="row_contraction", predicate=_is_row_contraction)
def row_contraction(func, meta: ShardMeta, args, kwargs):
    """The contraction over counted rows on every rank, summed over ranks (replicated)."""
    a, b = local(args[0]), local(args[1])
    rows = _counted_rows(meta, args[1], "a product over the rows")
    with torch._C.DisableTorchFunctionSubclass():
        partial = func(a[..., rows], b[rows])
    return replicated(all_reduce_sum(partial, meta.group), meta)


def _einsum_parts(args):
    equation, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    return equation.replace(" ", ""), operands


def _rows_letter(equation: str, operands, meta) -> str | None:
    """The subscript that labels the rows when an einsum sums over them, else None."""
    if "->" not in equation or "." in equation:
        return None
    inputs, output = equation.split("->")
    letters = inputs.split(",")
    if len(letters) != len(operands):
        return None
    for subscripts, x in zip(letters, operands):
        place = placement_of(x)
        if (place is not None and not place.is_opaque() and place.dim is not None and place.group == 1
                and len(subscripts) == x.dim() and subscripts[place.dim] not in output):
            return subscripts[place.dim]
    return None


def _is_row_einsum(func, meta, args, kwargs) -> bool:
    if kwargs or len(args) < 2 or not isinstance(args[0], str) or not _reduces_over_ranks(meta):
        return False
    return _rows_letter(*_einsum_parts(args), meta) is not None


@_on_rows(torch.einsum, name="row_einsum", predicate=_is_row_einsum)
def row_einsum(func, meta: ShardMeta, args, kwargs):
    """An einsum that sums over the rows (``"n,nk->k"``): counted rows of every operand
    that carries the rows' subscript, then summed over ranks (replicated)."""
    equation, operands = _einsum_parts(args)
    letter = _rows_letter(equation, operands, meta)
    plain = []
    for subscripts, x in zip(equation.split("->")[0].split(","), operands):
        place = placement_of(x)
        x = local(x)
        if letter in subscripts:
            if place is None or place.is_opaque() or subscripts[place.dim] != letter:
                raise NoRuleError(f"einsum {equation!r}: the operands' rows do not share the subscript "
                                  f"{letter!r}; sum over the rows of one operand at a time")
            axis = place.dim
            rows = slice(0, meta.n_owned) if place.kind == "atoms" else slice(None)
            x = x[(slice(None),) * axis + (rows,)]
        plain.append(x)
    with torch._C.DisableTorchFunctionSubclass():
        partial = torch.einsum(equation, *plain)
    return replicated(all_reduce_sum(partial, meta.group), meta)


# ---- composites: written with the rules above ------------------------------------------------
# Each runs on the ShardTensor itself, so its max, sums and means go through the rules
# above (counted rows, over ranks, replicated) and its elementwise steps stay per row.
_SOFTMAXES = {torch.nn.functional.softmax: False, torch.softmax: False, torch.Tensor.softmax: False,
              torch.nn.functional.log_softmax: True, torch.log_softmax: True, torch.Tensor.log_softmax: True}
_SPREADS = {torch.var: "var", torch.Tensor.var: "var", torch.std: "std", torch.Tensor.std: "std"}
_VECTOR_NORMS = (torch.linalg.vector_norm, torch.norm, torch.Tensor.norm, torch.linalg.norm)


def _softmax_over_rows(func, meta, args, kwargs) -> bool:
    if func not in _SOFTMAXES or set(kwargs) - {"dim", "dtype", "_stacklevel"}:
        return False
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return isinstance(dim, int) and dim in (0, -x.dim()) and _rows_reduced(torch.sum, meta, (x, 0), {})


@_on_rows(*_SOFTMAXES, name="row_softmax", predicate=_softmax_over_rows)
def row_softmax(func, meta: ShardMeta, args, kwargs):
    """softmax / log_softmax over all atoms (dim 0): shifted by the maximum over ranks,
    normalised by the sum over ranks."""
    x = args[0] if kwargs.get("dtype") is None else args[0].to(kwargs["dtype"])
    shifted = x - x.detach().amax(0, keepdim=True)  # the shift cancels: no gradient needed
    total = torch.exp(shifted).sum(0, keepdim=True)
    return shifted - torch.log(total) if _SOFTMAXES[func] else torch.exp(shifted) / total


def _logsumexp_over_rows(func, meta, args, kwargs) -> bool:
    return func in (torch.logsumexp, torch.Tensor.logsumexp) and _rows_reduced(func, meta, args, kwargs)


@_on_rows(torch.logsumexp, torch.Tensor.logsumexp, name="row_logsumexp", predicate=_logsumexp_over_rows)
def row_logsumexp(func, meta: ShardMeta, args, kwargs):
    x, dims = args[0], _sum_dims(args, kwargs)
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    peak = x.detach().amax(dims, keepdim=True)
    out = torch.log(torch.exp(x - peak).sum(dims, keepdim=True)) + peak
    return out if keepdim else out.squeeze(dims)


def _spread_over_rows(func, meta, args, kwargs) -> bool:
    """var/std with the dims given by position or name and the correction by name (the
    legacy positional ``unbiased`` stays refused: it is ambiguous with ``dim``)."""
    if func not in _SPREADS or len(args) > 2 or set(kwargs) - {"dim", "correction", "unbiased", "keepdim"}:
        return False
    if len(args) == 2 and isinstance(args[1], bool):
        return False
    return _rows_reduced(func, meta, args, kwargs)


@_on_rows(*_SPREADS, name="row_spread", predicate=_spread_over_rows)
def row_spread(func, meta: ShardMeta, args, kwargs):
    """Variance (or standard deviation) over rows: the mean over ranks, then the summed
    squared deviations over the number of elements of all ranks less the correction."""
    x, dims = args[0], _sum_dims(args, kwargs)
    keepdim = bool(kwargs.get("keepdim", False))
    correction = kwargs.get("correction")
    if correction is None:
        correction = 1 if kwargs.get("unbiased", True) else 0
    dims = tuple(range(x.dim())) if dims is None else dims
    deviation = x - x.mean(dims, keepdim=True)
    count = torch.ones_like(x.detach()).sum(dims, keepdim=keepdim)
    variance = (deviation * deviation).sum(dims, keepdim=keepdim) / (count - correction)
    return torch.sqrt(variance) if _SPREADS[func] == "std" else variance


def _vector_norm_over_rows(func, meta, args, kwargs) -> bool:
    """A p-norm of the whole tensor, or along dims that include the rows, for a number p
    (``torch.norm``'s default "fro" is 2; a matrix norm of ``linalg.norm`` stays refused)."""
    if func not in _VECTOR_NORMS or len(args) > 3 or set(kwargs) - {"ord", "p", "dim", "keepdim"}:
        return False
    order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
    if func is torch.linalg.norm and (args[1:2] or "ord" in kwargs) and args[0].dim() > 1:
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        if dim is None or not isinstance(dim, int):
            return False  # a matrix norm
    order = 2 if order in ("fro", None) else order
    return (isinstance(order, (int, float)) and not isinstance(order, bool) and order != 0
            and _rows_reduced(func, meta, args, kwargs))


@_on_rows(*_VECTOR_NORMS, name="row_vector_norm", predicate=_vector_norm_over_rows)
def row_vector_norm(func, meta: ShardMeta, args, kwargs):
    x = args[0]
    order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
    order = 2.0 if order in ("fro", None) else float(order)
    dims = _reduced_dims(func, args, kwargs)
    dims = tuple(range(x.dim())) if dims is None else dims
    keepdim = bool(kwargs.get("keepdim", False))
    magnitude = x.abs()
    if math.isinf(order):
        return magnitude.amax(dims, keepdim=keepdim) if order > 0 else magnitude.amin(dims, keepdim=keepdim)
    return (magnitude**order).sum(dims, keepdim=keepdim) ** (1.0 / order)


# ---- the rest: refused --------------------------------------------------------------------
# (max/min along dim 0 reach this rule only in the forms `row_extreme` declines: with a
# dim, which also returns the rows' positions)
@_on_rows(*_REFUSED, *_EXTREMES, name="row_reduction_refused", predicate=_rows_reduced)
def row_reduction_refused(func, meta: ShardMeta, args, kwargs):
    name = getattr(func, "__name__", str(func))
    raise NotImplementedError(
        f"`{name}` over the atom/edge rows (dim 0, or the whole tensor) under domain "
        f"decomposition: each rank holds only some rows, and there is no exact cross-rank rule "
        f"for `{name}` (in this form) here, so it would give a per-rank, wrong answer. Write it "
        "with sums, means, var/std, norms or amax/amin over the rows, reduce per system with "
        "index_add/scatter_add, or reduce along the other dimensions (dim=-1)"
    )


def _all_pairs_of_rows(func, meta, args, kwargs) -> bool:
    return _reduces_over_ranks(meta) and any(
        isinstance(x, ShardTensor) and getattr(placement_of(x), "kind", None) in ("atoms", "opaque")
        for x in args[:2])


@_on_rows(torch.cdist, name="all_pairs_refused", predicate=_all_pairs_of_rows)
def all_pairs_refused(func, meta: ShardMeta, args, kwargs):
    raise NotImplementedError(
        "torch.cdist over the atoms (all pairs) under domain decomposition: a rank holds its own "
        "atoms and a shell of ghosts within the cutoff, so the pairs it could form are not all "
        "pairs and the result would be wrong. Build pair terms from the neighbour list "
        "(batch.neighbors, within the cutoff); for long-range electrostatics use the ewald_pme "
        "plugin (Ewald, PME or DSF over the neighbour list)"
    )
