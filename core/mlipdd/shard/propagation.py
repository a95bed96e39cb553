"""Ops without a dispatch rule: the placement of their result, or a refusal.

# NOTE [refuse by default]
An op on atom or edge rows that no rule in `mlipdd.shard.registry` handled runs on this
rank's rows alone. That is right only when the op treats each row on its own (``x * 2``,
``silu``, a linear layer over the features, a sum over a feature dim, a transpose that
moves the rows elsewhere). Every such op is listed here, in one place, with how it moves
the rows dimension (`PROPAGATE`); its result gets that placement. Any other op on rows
raises `NoRuleError` on the rank, which `comm.fail_together` turns into the same error
on every rank: the op, where its input came from, and the fix. A user declares more
row-local ops with `declare_row_local`.

Integer and boolean tensors reduced over their rows stay local (NOTE [integer rows stay
local] in `mlipdd.shard.row_reductions`): they size a rank's own index structures. Their
results are `Opaque`, so a float computed from them is refused where it would matter.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from mlipdd.shard.counts import counted_rows, refuse_count_values
from mlipdd.shard.placement import Opaque, Rows, describe, placement_of

__all__ = ["PROPAGATE", "NoRuleError", "declare_row_local", "explain_failure", "output_placement"]


class NoRuleError(RuntimeError):
    """An op on atom or edge rows that mlipdd has no exact cross-rank rule for."""


def op_name(func) -> str:
    from mlipdd.shard.registry import _op_name

    return _op_name(func)


def refuse(func, place, arg: str, detail: str = "") -> NoRuleError:
    what = f" ({detail})" if detail else ""
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return NoRuleError(
            f"opaque custom op `{op_name(func)}` called on {describe(place)} [{arg}]: the dispatch cannot see "
            "inside it, so it would compute on this rank's rows alone and miss the other ranks'. Give it "
            f"an OpAdapter in the model's DistributionSpec.custom_ops, e.g. OpAdapter(op=\"{_op_key(func)}\", "
            "output_transforms={0: ScatterOutputs()}) for per-atom sums (mlipdd.spec.transforms lists the "
            "others); `mlipdd validate` proposes one."
        )
    return NoRuleError(
        f"`{op_name(func)}` on {describe(place)} [{arg}]{what}: mlipdd has no exact cross-rank rule for it, "
        "and run on this rank's rows alone it would give a different answer than one process. Fixes: "
        "write the reduction over atoms or edges as sum/mean/amax/amin, a scatter (index_add/scatter_add) "
        "or softmax/logsumexp/var/std/norm over dim 0 (exact rules); if the op treats each row on its own, "
        "declare it with `mlipdd.shard.declare_row_local(op)`; give an opaque kernel an OpAdapter in the "
        "model's DistributionSpec; or run the model under the graph_partition strategy."
    )


def _op_key(func) -> str:
    name = str(func._schema.name) if hasattr(func, "_schema") else func._qualified_op_name
    return name


# ---- helpers --------------------------------------------------------------------------------
def _input(args, kwargs):
    return args[0] if args else kwargs.get("input", kwargs.get("self"))


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _row_args(args, kwargs):
    """(name, tensor, placement) of every ShardTensor holding rows among the arguments."""
    found = []

    def visit(name, a):
        if getattr(a, "_meta", None) is not None and not a._meta.layout.is_replicated():
            found.append((name, a, placement_of(a)))
        elif isinstance(a, (list, tuple)):
            for i, x in enumerate(a):
                visit(f"{name}[{i}]", x)

    for i, a in enumerate(args):
        visit(f"argument {i}", a)
    for k, v in kwargs.items():
        visit(k, v)
    return found


# ---- pointwise: rows stay where they are (broadcast from the right) -------------------------
def pointwise(func, args, kwargs, out):
    refuse_count_values(func, args, kwargs, out)  # NOTE [counts are sizes]
    rows = _row_args(args, kwargs)
    ndim = out.dim() if isinstance(out, torch.Tensor) else None
    if ndim is None:
        return rows[0][2]
    place, opaque, stale = None, None, False
    for name, t, p in rows:
        moved = p if p.dim is None else p.moved(p.dim + ndim - t.dim())
        stale = stale or p.stale
        if p.is_opaque():
            opaque = opaque or moved
            continue
        if place is None:
            place = moved
        elif (moved.kind, moved.dim, moved.group) != (place.kind, place.dim, place.group):
            raise NoRuleError(
                f"`{op_name(func)}` combines {describe(place)} with {describe(moved)} [{name}]: an all-pairs "
                "or mixed-row product has no cross-rank rule (each rank holds only some of the rows). "
                "Pair atoms through the neighbour list's edges, or use the ewald_pme plugin for all pairs."
            )
    if func in _ORDERINGS and any(p.values == "atoms" for _, _, p in rows):
        raise NoRuleError(
            f"`{op_name(func)}` orders atom indices (an edge index's values): they are this rank's row "
            "numbers, which differ from one process's (ghost rows come last), so the edges it keeps "
            "differ too. Keep both directions of each pair and halve the pair energy, or compare "
            "something every rank agrees on (positions, global ids)."
        )
    if opaque is not None:
        return opaque
    if place.values is not None and (func not in _KEEP_VALUES or len(rows) > 1):
        place = replace(place, values=None)  # arithmetic on a system index: no longer one
    return replace(place, stale=stale) if stale != place.stale else place


# comparisons by order: of atom indices they depend on how each rank numbers its rows
_ORDERINGS = {torch.lt, torch.le, torch.gt, torch.ge, torch.Tensor.lt, torch.Tensor.le, torch.Tensor.gt,
              torch.Tensor.ge, torch.Tensor.__lt__, torch.Tensor.__le__, torch.Tensor.__gt__, torch.Tensor.__ge__,
              torch.less, torch.greater, torch.less_equal, torch.greater_equal}

# copies and conversions of an index keep what its values mean
_KEEP_VALUES = {torch.Tensor.clone, torch.clone, torch.Tensor.detach, torch.detach, torch.Tensor.to,
                torch.Tensor.contiguous, torch.Tensor.long, torch.Tensor.int, torch.Tensor.cpu, torch.Tensor.cuda}


# ---- ops along given dims --------------------------------------------------------------------
def _dims(x, dim) -> tuple[int, ...] | None:
    if dim is None:
        return None
    if isinstance(dim, int):
        return (_norm_dim(dim, max(x.dim(), 1)),)
    dims = tuple(_norm_dim(d, max(x.dim(), 1)) for d in dim)
    return dims or None  # amax(dim=()) reduces everything


def _arg(args, kwargs, position: int, name: str, default=None):
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


def reduction(dim_at: int = 1, default=None, keepdim_at: int | None = 2):
    """An op that reduces the dims it is given (all without one): the rows survive when
    the rows dim is not among them, moved left past the reduced dims before it."""

    def propagate(func, args, kwargs, out):
        x = _input(args, kwargs)
        p = placement_of(x)
        dims = _dims(x, _arg(args, kwargs, dim_at, "dim", default))
        if dims is None or p.dim is None or p.dim in dims:
            if not (x.is_floating_point() or x.is_complex()):
                return Opaque(_local_integers(func, p), None)
            raise refuse(func, p, "input", "it reduces over the rows")
        keep = bool(_arg(args, kwargs, keepdim_at, "keepdim", False)) if keepdim_at is not None else False
        return p if keep else p.moved(p.dim - sum(d < p.dim for d in dims))

    return propagate


def along(dim_at: int = 1, default=-1, name: str = "dim", integers_local: bool = True):
    """An op along one dim that keeps the rank (softmax, cumsum, sort, normalize): row-local
    unless that dim is the rows dim."""

    def propagate(func, args, kwargs, out):
        x = _input(args, kwargs)
        p = placement_of(x)
        d = _arg(args, kwargs, dim_at, name, default)
        d = _norm_dim(d, max(x.dim(), 1)) if d is not None else None
        if d is None or p.dim is None or d == p.dim or p.group != 1:
            if integers_local and not (x.is_floating_point() or x.is_complex()):
                return Opaque(_local_integers(func, p), p.dim)
            raise refuse(func, p, "input", "it runs along the rows")
        return p

    return propagate


def _norm(func, args, kwargs, out):
    """torch.norm / linalg.norm / vector_norm: ``dim`` after the order."""
    x = _input(args, kwargs)
    p = placement_of(x)
    dims = _dims(x, _arg(args, kwargs, 2, "dim"))
    if dims is None or p.dim is None or p.dim in dims:
        raise refuse(func, p, "input", "it reduces over the rows")
    keep = bool(_arg(args, kwargs, 3, "keepdim", False))
    return p if keep else p.moved(p.dim - sum(d < p.dim for d in dims))


# ---- linear algebra over the features ---------------------------------------------------------
def _linear(func, args, kwargs, out):
    x = _input(args, kwargs)
    p = placement_of(x)
    rows = _row_args(args[1:], {k: v for k, v in kwargs.items() if k != "input"})
    if rows:
        raise refuse(func, rows[0][2], rows[0][0], "the weights hold rows")
    if p.dim is None or p.dim < x.dim() - 1:
        return p
    raise refuse(func, p, "input", "it contracts the rows")


def _layer_norm(func, args, kwargs, out):
    """layer_norm / rms_norm over trailing feature dims: row-local unless they hold the rows."""
    x = _input(args, kwargs)
    p = placement_of(x)
    shape = _arg(args, kwargs, 1, "normalized_shape")
    width = 1 if isinstance(shape, int) else len(shape)
    if p.dim is not None and p.dim < x.dim() - width:
        return p
    raise refuse(func, p, "input", "it normalises over the rows")


def _embedding(func, args, kwargs, out):
    index, weight = args[0], (args[1] if len(args) > 1 else kwargs["weight"])
    if _row_args((weight,), {}):
        raise refuse(func, placement_of(weight), "weight", "the table holds rows")
    return placement_of(index)


def _one_hot(func, args, kwargs, out):
    """``one_hot(x, num_classes)`` encodes each row on its own; with ``num_classes`` left to
    be inferred (-1) its width is this rank's largest value + 1, which differs between ranks."""
    x = _input(args, kwargs)
    if _arg(args, kwargs, 1, "num_classes", -1) < 0:
        raise refuse(func, placement_of(x), "input", "num_classes inferred from this rank's largest value; "
                     "pass num_classes")
    return placement_of(x)


def _diagonal(func, args, kwargs, out):
    """``x.diagonal(offset, dim1, dim2)`` of two dims other than the rows: row-local (the
    diagonal is appended last)."""
    x = _input(args, kwargs)
    p = placement_of(x)
    if p.dim is None:
        return p
    dims = {_norm_dim(_arg(args, kwargs, 2, "dim1", 0), x.dim()), _norm_dim(_arg(args, kwargs, 3, "dim2", 1), x.dim())}
    if p.dim in dims:
        raise refuse(func, p, "input", "a diagonal across the rows")
    return p.moved(p.dim - sum(k < p.dim for k in dims))


def _baddbmm(func, args, kwargs, out):
    """``input + batch1 @ batch2`` with the rows the batch dim of all three (nequip's per-edge
    ``shift @ cell``), or of the product's factors with a plain ``input`` broadcast along them."""
    inp, b1, b2 = args[0], args[1], args[2]
    pieces = [placement_of(t) if getattr(t, "_meta", None) is not None else None for t in (inp, b1, b2)]
    p1, p2 = pieces[1], pieces[2]
    if p1 is None or p2 is None:
        raise refuse(func, p1 or p2 or pieces[0], "batch1, batch2", "a batched product over the rows of one factor")
    place = _batched_product(func, b1, b2, p1, p2, out)
    pi = pieces[0]
    if (pi is None and inp.shape[0] != 1) or (pi is not None and (pi.dim, pi.kind) != (place.dim, place.kind)):
        raise refuse(func, pi or place, "input", "an addend that does not hold the product's rows")
    return place


def _batched_product(func, a, b, pa, pb, out):
    """Both operands hold rows: exact only along a shared batch dim (per-edge ``bmm``)."""
    if None not in (pa.dim, pb.dim) and a.dim() >= 3 and b.dim() >= 3 and pa.dim < a.dim() - 2 \
            and a.dim() - pa.dim == b.dim() - pb.dim and (pa.kind == pb.kind or "opaque" in (pa.kind, pb.kind)):
        place = pa if pb.kind != "opaque" else pb
        return place.moved(out.dim() - (a.dim() - pa.dim))
    raise refuse(func, pa, "both operands", "a product of two row tensors over their rows")


def _matmul(func, args, kwargs, out):
    """``a @ b``: rows of ``a`` along its matrix rows or batch dims, or of ``b`` along its
    columns or batch dims, survive; rows on the contracted dim are the rule's (``q @ x``)."""
    a, b = args[0], args[1]
    pa = placement_of(a) if getattr(a, "_meta", None) is not None else None
    pb = placement_of(b) if getattr(b, "_meta", None) is not None else None
    if pa is not None and pb is not None:
        return _batched_product(func, a, b, pa, pb, out)
    if (pa or pb).dim is None:
        return pa or pb
    matrix_out = out.dim() - (a.dim() >= 2) - (b.dim() >= 2)  # batch dims of the result
    if pa is not None:
        if a.dim() == 1 or pa.dim == a.dim() - 1:
            raise refuse(func, pa, "argument 0", "it contracts the rows")
        if pa.dim == a.dim() - 2:
            return pa.moved(matrix_out)
        return pa.moved(pa.dim + matrix_out - (a.dim() - 2))
    if b.dim() == 1 or pb.dim == b.dim() - 2:
        raise refuse(func, pb, "argument 1", "it contracts the rows")
    if pb.dim == b.dim() - 1:
        return pb.moved(out.dim() - 1)
    return pb.moved(pb.dim + matrix_out - (b.dim() - 2))


def _einsum_operands(args):
    operands = args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    return args[0].replace(" ", ""), operands


def _explicit_einsum(equation: str, operands) -> tuple[list[str], str]:
    """The equation with ``...`` spelled out in unused letters and the output written."""
    inputs, _, output = equation.partition("->")
    terms = inputs.split(",")
    spare = iter(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in equation)
    width = max((x.dim() - len(t.replace("...", "")) for t, x in zip(terms, operands) if "..." in t), default=0)
    fill = "".join(next(spare) for _ in range(width))
    terms = [t.replace("...", fill[len(fill) - (x.dim() - len(t.replace("...", ""))):] if "..." in t else t)
             for t, x in zip(terms, operands)]
    if "->" not in equation:
        letters = "".join(terms)
        output = fill + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in fill))
    else:
        output = output.replace("...", fill)
    return terms, output


def _einsum(func, args, kwargs, out):
    equation, operands = _einsum_operands(args)
    terms, output = _explicit_einsum(equation, operands)
    inputs = ",".join(terms)
    place = None
    for subscripts, x in zip(inputs.split(","), operands):
        p = placement_of(x) if getattr(x, "_meta", None) is not None else None
        if p is None:
            continue
        if p.dim is None:
            return p
        letter = subscripts[p.dim]
        if letter not in output:
            raise refuse(func, p, f"operand {subscripts!r}", "it sums over the rows")
        moved = p.moved(output.index(letter))
        if place is not None and (place.kind, place.dim, place.group) != (moved.kind, moved.dim, moved.group):
            raise refuse(func, p, f"operand {subscripts!r}", "operands hold rows along different letters")
        place = moved
    return place


def _tensordot(func, args, kwargs, out):
    a, b = args[0], args[1]
    dims = _arg(args, kwargs, 2, "dims", 2)
    if isinstance(dims, int):
        da, db = list(range(a.dim() - dims, a.dim())), list(range(dims))
    else:
        da, db = ([dims[0]] if isinstance(dims[0], int) else list(dims[0])), (
            [dims[1]] if isinstance(dims[1], int) else list(dims[1]))
        da, db = [_norm_dim(d, a.dim()) for d in da], [_norm_dim(d, b.dim()) for d in db]
    pa = placement_of(a) if getattr(a, "_meta", None) is not None else None
    pb = placement_of(b) if getattr(b, "_meta", None) is not None else None
    if pa is not None and pb is not None:
        raise refuse(func, pa, "both operands", "a product of two row tensors")
    if (pa or pb).dim is None:
        return pa or pb
    if pa is not None:
        if pa.dim in da:
            raise refuse(func, pa, "argument 0", "it contracts the rows")
        return pa.moved(sum(d not in da for d in range(pa.dim)))
    if pb.dim in db:
        raise refuse(func, pb, "argument 1", "it contracts the rows")
    free_a = a.dim() - len(da)
    return pb.moved(free_a + sum(d not in db for d in range(pb.dim)))


# ---- shapes ---------------------------------------------------------------------------------
def _known_rows(rule):
    """A rule for rows of ``args[0]`` on a known dim (opaque rows whose dim was lost stay so);
    ``rule(func, args, kwargs, out, x, place)``."""

    def propagate(func, args, kwargs, out):
        x = _input(args, kwargs)
        place = placement_of(x)
        return place if place.dim is None else rule(func, args, kwargs, out, x, place)

    return propagate



def _reshaped(p: Rows, old: tuple, new: tuple):
    """Where rows go under a row-major reshape ``old -> new``, or Opaque."""
    if p.dim is None:
        return p
    before = math.prod(old[: p.dim])
    per_row = p.group * math.prod(old[p.dim + 1:])  # entries per row from the rows dim on
    n = old[p.dim] // p.group if p.group else 0
    for d in range(len(new)):
        if math.prod(new[:d]) != before:
            if math.prod(new[:d]) > before and before != 0:
                break
            continue
        after = math.prod(new[d + 1:])
        if after == 0 or per_row % after:
            continue
        group = per_row // after
        if new[d] == n * group:
            return p.moved(d, group)
    return Opaque(f"a reshape {tuple(old)} -> {tuple(new)} mixed the rows with the dims around them", None)


def _shape_arg(args, kwargs, first: int = 1):
    size = args[first:] if len(args) > first else kwargs.get("shape", kwargs.get("size", ()))
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = size[0]
    return tuple(size)


def _reshape(func, args, kwargs, out):
    x = _input(args, kwargs)
    return _reshaped(placement_of(x), tuple(x.shape), tuple(out.shape))


def _transpose(func, args, kwargs, out):
    x = _input(args, kwargs)
    p = placement_of(x)
    if p.dim is None or x.dim() < 2:
        return p
    if func in (torch.Tensor.t, torch.t, torch.Tensor.T.__get__, torch.Tensor.mT.__get__):
        d0, d1 = x.dim() - 2, x.dim() - 1
        if func in (torch.Tensor.t, torch.t, torch.Tensor.T.__get__):
            d0, d1 = 0, 1
    else:
        d0 = _norm_dim(_arg(args, kwargs, 1, "dim0"), x.dim())
        d1 = _norm_dim(_arg(args, kwargs, 2, "dim1"), x.dim())
    return p.moved(d1 if p.dim == d0 else d0 if p.dim == d1 else p.dim)


@_known_rows
def _permute(func, args, kwargs, out, x, p):
    order = [_norm_dim(d, x.dim()) for d in _shape_arg(args, kwargs)] if not kwargs.get("dims") else \
        [_norm_dim(d, x.dim()) for d in kwargs["dims"]]
    return p.moved(order.index(p.dim))


@_known_rows
def _movedim(func, args, kwargs, out, x, p):
    src, dst = _arg(args, kwargs, 1, "source"), _arg(args, kwargs, 2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    src, dst = [_norm_dim(d, x.dim()) for d in src], [_norm_dim(d, x.dim()) for d in dst]
    order = [None] * x.dim()
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(d for d in range(x.dim()) if d not in src)
    order = [o if o is not None else next(rest) for o in order]
    return p.moved(order.index(p.dim))


@_known_rows
def _unsqueeze(func, args, kwargs, out, x, p):
    d = _norm_dim(_arg(args, kwargs, 1, "dim"), x.dim() + 1)
    return p.moved(p.dim + (d <= p.dim))


@_known_rows
def _squeeze(func, args, kwargs, out, x, p):
    dims = _dims(x, _arg(args, kwargs, 1, "dim"))
    removed = [d for d in range(x.dim()) if x.shape[d] == 1 and (dims is None or d in dims)]
    if p.dim in removed:
        raise NoRuleError(
            f"`{op_name(func)}` would remove the rows dim of {describe(p)}: this rank has one row there, "
            "other ranks have more (or none). Squeeze the dims you mean by number, e.g. x.squeeze(-1)."
        )
    return p.moved(p.dim - sum(d < p.dim for d in removed))


def _expand(func, args, kwargs, out):
    x = _input(args, kwargs)
    p = placement_of(x)
    return p if p.dim is None else p.moved(p.dim + out.dim() - x.dim())


def _same_dims_unless(dim_at: int, name: str, what: str):
    """narrow/select-like ops along one dim: row-local off the rows dim, opaque on it."""

    def propagate(func, args, kwargs, out):
        x = _input(args, kwargs)
        p = placement_of(x)
        if p.dim is None:
            return p
        d = _norm_dim(_arg(args, kwargs, dim_at, name, 0), x.dim())
        if d == p.dim:
            gone = func in (torch.Tensor.select, torch.select)
            return Opaque(f"`{op_name(func)}` {what} of the rows by position (which atoms those are depends "
                          "on the rank)", None if gone else d)
        if func in (torch.Tensor.select, torch.select):
            return p.moved(p.dim - (d < p.dim))
        return p

    return propagate


def _unbind(func, args, kwargs, out):
    x = _input(args, kwargs)
    p = placement_of(x)
    d = _norm_dim(_arg(args, kwargs, 1, "dim", 0), x.dim())
    if p.dim is None or d == p.dim:
        return Opaque("`unbind` along the rows", None)
    return p.moved(p.dim - (d < p.dim))


def _one_place(func, rows):
    """The placement shared by a list of row tensors (cat, stack); opaque ones make it opaque."""
    opaque = next((p for _, _, p in rows if p.is_opaque()), None)
    places = {(p.kind, p.dim, p.group) for _, _, p in rows if not p.is_opaque()}
    if len(places) > 1:
        raise refuse(func, rows[0][2], "tensors", "the tensors hold rows in different places")
    return opaque or rows[0][2]


def _cat(func, args, kwargs, out):
    tensors = args[0] if args else kwargs["tensors"]
    d = _norm_dim(_arg(args, kwargs, 1, "dim", 0), out.dim())
    p = _one_place(func, _row_args((tensors,), {}))
    if p.dim == d:
        return Opaque("`cat` along the rows (rows of different tensors one after another)", d)
    return p


def _stack(func, args, kwargs, out):
    tensors = args[0] if args else kwargs["tensors"]
    d = _norm_dim(_arg(args, kwargs, 1, "dim", 0), out.dim())
    p = _one_place(func, _row_args((tensors,), {}))
    return p if p.dim is None else p.moved(p.dim + (d <= p.dim))


def _is_bool_mask(i) -> bool:
    return isinstance(i, torch.Tensor) and i.dtype == torch.bool


def _is_index(i) -> bool:
    return isinstance(i, list) or (isinstance(i, torch.Tensor) and (i.dim() > 0 or i.dtype == torch.bool))


def _is_row_numbers(index, rows: int) -> bool:
    """``index`` is ``arange(rows)``: each row reads itself (a plain index, checked by value)."""
    if getattr(index, "_meta", None) is not None or not isinstance(index, torch.Tensor):
        return False
    if index.dim() != 1 or index.shape[0] != rows or index.dtype in (torch.bool, torch.float32, torch.float64):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return bool(torch.equal(index, torch.arange(rows, device=index.device, dtype=index.dtype)))


def _getitem(func, args, kwargs, out):
    x, index = args[0], args[1]
    items = index if isinstance(index, tuple) else (index,)
    p = placement_of(x) if getattr(x, "_meta", None) is not None else None
    if p is None:  # a plain table read by row indices (``table[z]``, ``pair_table[z_i, z_j]``)
        rows = _row_args((index,), {})
        lined_up = all(_is_index(i) and not _is_bool_mask(i) for i in items) and len(
            {(q.kind, q.dim, q.group) for _, _, q in rows}) == 1
        if rows and lined_up and all(q.dim == 0 and t.dim() == 1 for _, t, q in rows):
            return replace(rows[0][2], values=None)
        if len(items) == 1 and rows and not _is_bool_mask(items[0]):
            return replace(rows[0][2], values=None)
        return Opaque("a table read by an index holding rows", None) if rows else None
    if p.dim is None:
        return p
    if sum(_is_index(i) for i in items) > 1:
        if p.dim == 0 and _is_row_numbers(items[0], x.shape[0]):
            return p  # x[arange(n), k]: one entry of each row, as mace picks a head per atom
        return Opaque("rows read by several index tensors", None)
    width = sum(i.dim() if _is_bool_mask(i) else 1 for i in items if i is not None and i is not Ellipsis)
    dim_in, dim_out = 0, 0
    for item in items:
        if item is Ellipsis:
            skip = x.dim() - width
            if dim_in <= p.dim < dim_in + skip:
                return p.moved(dim_out + p.dim - dim_in)
            dim_in, dim_out = dim_in + skip, dim_out + skip
        elif item is None:
            dim_out += 1
        elif isinstance(item, slice):
            if dim_in == p.dim:
                if item != slice(None):
                    return Opaque("a slice of the rows by position", dim_out)
                return p.moved(dim_out)
            dim_in, dim_out = dim_in + 1, dim_out + 1
        elif _is_index(item):
            span = item.dim() if _is_bool_mask(item) else 1
            if dim_in <= p.dim < dim_in + span:
                if _is_bool_mask(item) and p.kind == "edges" and span == 1 and p.group == 1:
                    return p.moved(dim_out)  # some of this rank's edges: each still on one rank
                return Opaque("rows selected or reordered by an index", dim_out)
            dim_in, dim_out = dim_in + span, dim_out + 1
        else:  # an int, or a 0-d index
            if dim_in == p.dim:
                return Opaque("one row read by its position (which atom that is depends on the rank)", None)
            dim_in += 1
    return p.moved(dim_out + p.dim - dim_in)


def _atoms_by_atoms(x, holders) -> bool:
    """``x`` is a matrix over pairs of atoms (its first two dims both count the atom rows)."""
    meta = holders[0][1]._meta
    return x.dim() >= 2 and x.shape[0] == x.shape[1] == meta.n_padded


def _put(func, args, kwargs, out):
    """``x[i, j] = v`` / ``x.index_put_((i, j), v)``: a write by position. Floats written
    at pairs of row indices assemble a matrix over the atoms (charge equilibration's
    ``A[rcv, snd] = ...``), of which each rank would fill only its own rows' entries."""
    x = args[0]
    if func is torch.Tensor.__setitem__:
        items, value = (args[1] if isinstance(args[1], tuple) else (args[1],)), args[2]
    else:
        items, value = args[1], _arg(args, kwargs, 2, "values")
    holders = _row_args((items, value), {})
    floats = isinstance(value, torch.Tensor) and value.is_floating_point()
    if floats and holders and sum(_is_index(i) for i in items) > 1 and _atoms_by_atoms(x, holders):
        raise NoRuleError(
            f"`{op_name(func)}` writes {describe(holders[0][2])} into a matrix indexed by pairs of rows: "
            "each rank holds only some rows, so each would fill only its own part of the matrix and "
            "solve a different system. Assemble per-atom terms with index_add/scatter_add instead, use "
            "the ewald_pme plugin's charge equilibration, or run the model under graph_partition."
        )
    return placement_of(x) if getattr(x, "_meta", None) is not None else None


def _scatter_without_rule(func, args, kwargs, out):
    """A scatter no rule took: into rows that are neither atoms nor systems."""
    target = _input(args, kwargs)
    meta = next(t for _, t, _ in _row_args(args, kwargs))._meta
    rows = target.shape[_norm_dim(_arg(args, kwargs, 1, "dim"), target.dim())]
    raise NoRuleError(
        f"`{op_name(func)}` into {rows} rows that are neither this rank's atoms ({meta.n_padded}) nor its "
        f"systems ({meta.n_systems}): a per-element table, an edge table or a histogram filled from rows "
        "split over ranks would hold only this rank's share. Scatter into atom rows or per-system rows "
        "(exact rules), or reduce the table over ranks yourself with index_add into per-system rows."
    )


def _index_select(func, args, kwargs, out):
    x = _input(args, kwargs)
    d = _norm_dim(_arg(args, kwargs, 1, "dim"), x.dim())
    index = _arg(args, kwargs, 2, "index")
    if getattr(x, "_meta", None) is None:  # a plain table read by a row index
        q = placement_of(index)
        return q.moved(d) if q.dim is not None else q
    p = placement_of(x)
    if p.dim is None:
        return p
    if d == p.dim:
        return Opaque("rows selected by an index", d)
    return p


def _gather(func, args, kwargs, out):
    x = _input(args, kwargs)
    d = _norm_dim(_arg(args, kwargs, 1, "dim"), x.dim())
    index = _arg(args, kwargs, 2, "index")
    p = placement_of(x) if getattr(x, "_meta", None) is not None else None
    q = placement_of(index) if getattr(index, "_meta", None) is not None else None
    if p is not None and (p.dim is None or p.dim == d):
        return Opaque("rows gathered by an index", None if p.dim is None else d)
    return p or q


def _local_integers(func, p) -> str:
    """Why integer rows reduced, sorted or counted on this rank are opaque. Grouping the
    edges by an atom index is how triplets are built: say which edges a rank lacks."""
    if p is not None and p.values == "atoms":
        return (f"`{op_name(func)}` of an edge index's atom numbers: it groups this rank's edges by atom, and a "
                "rank holds only the edges whose RECEIVER it owns, so a ghost atom's edges and the edges "
                "leaving an atom towards atoms owned elsewhere are missing here (triplets of edges sharing "
                "a sender, DimeNet's k->j->i chains); NOTE [integer rows stay local]")
    return f"`{op_name(func)}` of integer rows on this rank only (NOTE [integer rows stay local])"


def _rank_local_integers(func, args, kwargs, out):
    """Counts, unique values and positions of this rank's rows: its own index structures
    (NOTE [integer rows stay local]); opaque, so a float made from them is refused where
    it would reduce or scatter."""
    x = _input(args, kwargs)
    return Opaque(_local_integers(func, placement_of(x) if getattr(x, "_meta", None) is not None else None), None)


def _where(func, args, kwargs, out):
    """``torch.where(c, a, b)`` is elementwise; ``torch.where(mask)`` lists row positions."""
    if len(args) + len(kwargs) == 1:
        return [_rank_local_integers(func, args, kwargs, o) for o in out]
    return pointwise(func, args, kwargs, out)


def _fresh(func, args, kwargs, out):
    """A new tensor of a given size (``x.new_zeros(n, 3)``). A leading size read from rows
    (``n = positions.shape[0]``, NOTE [counts are sizes]) makes rows of that kind; a plain
    size equal to ``x``'s own row count rows of ``x``'s kind (``edges.new_zeros((0, 3))`` on
    a rank with no atoms and no edges is edges); otherwise rows by the row count, as a
    plain accumulator's are."""
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or func is torch.Tensor.new_tensor:
        return None
    size = args[1] if len(args) > 1 else kwargs.get("size")
    lead = size[0] if isinstance(size, (tuple, list, torch.Size)) and size else size
    counted = counted_rows(lead)
    if counted is not None:
        return Rows(counted.kind) if counted.kind != "opaque" else None
    x = _input(args, kwargs)
    p = placement_of(x) if getattr(x, "_meta", None) is not None else None
    if p is not None and p.leads() and out.shape[0] == x.shape[0]:
        return Rows(p.kind)
    return None


Propagate = Callable[..., object]
PROPAGATE: dict[object, Propagate] = {}


def _table(rule: Propagate, *ops) -> None:
    for op in ops:
        PROPAGATE[op] = _rows_elsewhere(rule) if rule is not pointwise else rule


def _rows_elsewhere(rule: Propagate) -> Propagate:
    """A rule written for rows in the first argument, applied to a call whose rows are only
    in the others (``plain.expand_as(rows)``, ``torch.where(mask, plain, rows)``): the
    result lines up with those rows as in broadcasting."""

    def propagate(func, args, kwargs, out):
        x = _input(args, kwargs)
        if getattr(x, "_meta", None) is None and not isinstance(x, (list, tuple)) and rule not in _READS:
            return pointwise(func, args, kwargs, out)
        return rule(func, args, kwargs, out)

    return propagate


def declare_row_local(*ops) -> None:
    """Declare ops that treat every row on its own, elementwise (a custom activation, a
    kernel applied per atom): their results keep the rows where their inputs have them.

    Only for ops that truly are row-local; one that mixes rows (a sort, a running sum, a
    normalisation over atoms) gives a silently wrong answer under domain decomposition.
    """
    _table(pointwise, *ops)


def _methods(*names):
    out = []
    for n in names:
        for owner in (torch.Tensor, torch, F, torch.special, torch.linalg):
            f = getattr(owner, n, None)
            if f is not None and callable(f):
                out.append(f)
    return out


_POINTWISE = _methods(
    # arithmetic and comparison, with their in-place and reflected forms
    *[f"__{n}__" for n in ("add", "radd", "iadd", "sub", "rsub", "isub", "mul", "rmul", "imul", "truediv",
                          "rtruediv", "itruediv", "div", "rdiv", "floordiv", "rfloordiv", "mod", "rmod", "pow",
                          "rpow", "ipow", "neg", "pos", "abs", "eq", "ne", "lt", "le", "gt", "ge", "and", "rand",
                          "or", "ror", "xor", "rxor", "invert", "lshift", "rshift")],
    *[n for n in ("add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow",
                      "neg", "abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
                      "square", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "arcsin", "arccos",
                      "arctan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf", "erfc",
                      "erfinv", "clamp", "clamp_min", "clamp_max", "clip", "sign", "sgn", "floor", "ceil",
                      "round", "trunc", "frac", "reciprocal", "relu", "eq", "ne", "lt", "le", "gt", "ge",
                      "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or",
                      "bitwise_not", "maximum", "minimum", "fmax", "fmin", "lerp", "addcmul", "addcdiv",
                      "hypot", "xlogy", "sinc", "lgamma", "digamma", "masked_fill", "fill", "zero",
                      "nan_to_num", "copysign", "heaviside", "logit", "float_power", "deg2rad", "rad2deg",
                      "isnan", "isinf", "isfinite", "isneginf", "isposinf", "signbit", "copy")],
    *[n + "_" for n in ("add", "sub", "mul", "div", "pow", "neg", "abs", "exp", "log", "sqrt", "clamp",
                        "clamp_min", "clamp_max", "sigmoid", "tanh", "relu", "masked_fill", "fill", "zero",
                        "copy", "sin", "cos", "square", "reciprocal", "nan_to_num", "addcmul", "addcdiv",
                        "clip", "floor", "ceil", "round", "sign", "erf", "lerp")],
    "clone", "detach", "detach_", "contiguous", "to", "type", "type_as", "double", "float", "half",
    "bfloat16", "long", "int", "bool", "short", "byte", "cpu", "cuda", "requires_grad_", "retain_grad",
    "zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like",
    "pin_memory", "record_stream", "real", "imag", "conj", "angle", "polar", "complex",
    # activations and per-element nets (torch.nn.functional)
    "silu", "gelu", "elu", "selu", "celu", "leaky_relu", "relu6", "hardtanh", "hardswish", "hardsigmoid",
    "softplus", "softsign", "mish", "tanhshrink", "logsigmoid", "threshold", "dropout", "alpha_dropout",
    "expit", "ndtr", "log_ndtr", "xlog1py", "i0", "i0e", "i1", "i1e", "erfcx",
    "spherical_bessel_j0", "bessel_j0", "bessel_j1", "entr",
)


_READS: set = set()  # rules that read a plain table by a row index themselves


def _register_defaults() -> None:
    _READS.update({_getitem, _put, _scatter_without_rule, _index_select, _gather, _embedding, _matmul, _tensordot,
                   _einsum})
    _table(pointwise, *_POINTWISE)
    _table(reduction(), torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean, torch.nansum,
           torch.Tensor.nansum, torch.nanmean, torch.Tensor.nanmean, torch.prod, torch.Tensor.prod,
           torch.amax, torch.Tensor.amax, torch.amin, torch.Tensor.amin, torch.any, torch.Tensor.any,
           torch.all, torch.Tensor.all, torch.logsumexp, torch.Tensor.logsumexp,
           torch.std, torch.Tensor.std, torch.var, torch.Tensor.var, torch.count_nonzero,
           torch.Tensor.count_nonzero, torch.argmax, torch.Tensor.argmax, torch.argmin, torch.Tensor.argmin,
           torch.max, torch.Tensor.max, torch.min, torch.Tensor.min, torch.median, torch.Tensor.median,
           torch.aminmax, torch.std_mean, torch.var_mean)
    _table(_norm, torch.norm, torch.Tensor.norm, torch.linalg.norm, torch.linalg.vector_norm)
    _table(along(), torch.softmax, torch.Tensor.softmax, F.softmax, torch.log_softmax,
           torch.Tensor.log_softmax, F.log_softmax, torch.cumsum, torch.Tensor.cumsum, torch.cumprod,
           torch.Tensor.cumprod, torch.sort, torch.Tensor.sort, torch.argsort, torch.Tensor.argsort,
           torch.cummax, torch.Tensor.cummax, torch.cummin, torch.Tensor.cummin, torch.logcumsumexp,
           torch.Tensor.logcumsumexp)
    _table(along(dim_at=2, default=-1), torch.topk, torch.Tensor.topk, torch.kthvalue, torch.Tensor.kthvalue)
    _table(along(dim_at=2, default=1), F.normalize)
    _table(along(dim_at=2, default=-1), torch.diff, torch.Tensor.diff)
    _table(_linear, F.linear)
    _table(_embedding, F.embedding)
    _table(_one_hot, F.one_hot)
    _table(_diagonal, torch.diagonal, torch.Tensor.diagonal)
    _table(_baddbmm, torch.baddbmm, torch.Tensor.baddbmm)
    _table(_layer_norm, F.layer_norm, torch.layer_norm, *([F.rms_norm] if hasattr(F, "rms_norm") else []))
    _table(_matmul, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
           torch.bmm, torch.Tensor.bmm, torch.mv, torch.Tensor.mv)
    _table(_einsum, torch.einsum)
    _table(_tensordot, torch.tensordot)
    _table(_reshape, torch.reshape, torch.Tensor.reshape, torch.Tensor.view, torch.Tensor.view_as,
           torch.Tensor.reshape_as, torch.flatten, torch.Tensor.flatten, torch.Tensor.unflatten, torch.unflatten,
           torch.ravel, torch.Tensor.ravel)
    _table(_transpose, torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes,
           torch.swapdims, torch.Tensor.swapdims, torch.t, torch.Tensor.t, torch.Tensor.T.__get__,
           torch.Tensor.mT.__get__)
    _table(_permute, torch.permute, torch.Tensor.permute)
    _table(_movedim, torch.movedim, torch.Tensor.movedim, torch.moveaxis, torch.Tensor.moveaxis)
    _table(_unsqueeze, torch.unsqueeze, torch.Tensor.unsqueeze)
    _table(_squeeze, torch.squeeze, torch.Tensor.squeeze)
    _table(_expand, torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to, torch.Tensor.broadcast_to)
    _table(_same_dims_unless(1, "dim", "a slice"), torch.narrow, torch.Tensor.narrow, torch.select,
           torch.Tensor.select)
    _table(_same_dims_unless(2, "dim", "a split"), torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk,
           torch.tensor_split, torch.Tensor.tensor_split)
    _table(_unbind, torch.unbind, torch.Tensor.unbind)
    _table(_cat, torch.cat, torch.concat, torch.concatenate)
    _table(_stack, torch.stack)
    _table(_getitem, torch.Tensor.__getitem__)
    _table(_put, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put, torch.index_put)
    _table(_scatter_without_rule, torch.Tensor.scatter_add, torch.Tensor.scatter_add_, torch.scatter_add,
           torch.Tensor.index_add, torch.Tensor.index_add_, torch.index_add, torch.Tensor.scatter_reduce,
           torch.Tensor.scatter_reduce_, torch.scatter_reduce, torch.Tensor.index_reduce,
           torch.Tensor.index_reduce_, torch.index_reduce, torch.Tensor.scatter, torch.Tensor.scatter_,
           torch.scatter)
    _table(_index_select, torch.index_select, torch.Tensor.index_select)
    _table(_gather, torch.gather, torch.Tensor.gather, torch.take_along_dim, torch.Tensor.take_along_dim)
    _table(_where, torch.where)
    _table(_fresh, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full,
           torch.Tensor.new_tensor)
    _table(_rank_local_integers, torch.bincount, torch.Tensor.bincount, torch.unique, torch.Tensor.unique,
           torch.unique_consecutive, torch.Tensor.unique_consecutive, torch.histc, torch.Tensor.histc,
           torch.searchsorted, torch.bucketize, torch.nonzero, torch.Tensor.nonzero, torch.argwhere)


_register_defaults()


def _broadcast_tensors(func, args, kwargs, out):
    return [pointwise(func, (t,), {}, o) if getattr(t, "_meta", None) is not None else None
            for t, o in zip(args, out)]


PROPAGATE[torch.broadcast_tensors] = _broadcast_tensors


def explain_failure(func, args, kwargs, error: Exception) -> None:
    """NOTE [failed on this rank]: an op on rows can fail in torch on one rank before its
    refusal is reached (``topk(k)`` or ``max()`` on a rank that owns no atom, an index past
    this rank's rows), while the other ranks raise the refusal: each rank must stop with
    the op and the fix. Raise the refusal the op would get, else one naming the op, its
    rows and the fix; under sharded storage ``error`` is only tagged with the op, and
    `owned_rows_scope` words it after its own checks (a plain tensor read past the rows)."""
    with contextlib.suppress(AttributeError, TypeError, IndexError, ValueError):  # a rule reading the result
        try:
            output_placement(func, args, kwargs, None)
        except NoRuleError as refusal:
            raise refusal from error
    rows = _row_args(args, kwargs)
    if not rows:
        return
    error.mlipdd_op = f"`{op_name(func)}` on {describe(rows[0][2])}"
    meta = rows[0][1]._meta
    if not meta.layout.is_sharded():
        raise NoRuleError(failed_on_rank(error, meta.n_owned)) from error


def failed_on_rank(error: Exception, n_owned: int, where: str = "") -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return (
        f"{error.mlipdd_op} failed on this rank{where} ({type(error).__name__}: {first}): this rank "
        f"holds {n_owned} of the system's atoms, one process all of them, so a size, a k or an index "
        "that fits the whole system need not fit here (an empty tensor on a rank that owns no atom, an "
        "index table built from this rank's edges pointing past its rows). Write the step so that it "
        "holds for any number of rows (reduce over atoms with sum/mean/amax/amin over dim 0 or a "
        "scatter; read neighbours as h[edge_index[0]] from tensors derived from the inputs), or run "
        "the model under the graph_partition strategy."
    )


def output_placement(func, args, kwargs, out):
    """The placement(s) of ``func``'s result, or NoRuleError; called only when ``func``
    has rows among its arguments and no dispatch rule."""
    rule = PROPAGATE.get(func)
    if rule is None:
        rows = _row_args(args, kwargs)
        name, _, place = rows[0]
        raise refuse(func, place, name)
    return rule(func, args, kwargs, out)
