"""Matrix products: over features row-local, over the rows a sum (local + all_reduce).

``h @ W`` keeps h's rows; ``x.t() @ y`` contracts the rows of both (a covariance, a
parameter's gradient ``rbf.t() @ grad``): the rows that count once, summed, all-reduced.
``einsum`` and ``matmul`` reach the dispatch as these ops after torch's decomposition.
"""

from __future__ import annotations

import torch

from mlipdd.shard.aten import comm
from mlipdd.shard.aten.placement import GHOSTED, OWNED, REPLICATE, SHARES, Rows
from mlipdd.shard.aten.rules import as_ghosted, as_owned, finish, refuse, rows_of, rule, uniform_along, valid_rows
from mlipdd.shard.aten.tensor import unwrap

aten = torch.ops.aten


def _contract_rows(func, a, b, args, kwargs):
    """Both operands hold the same rows along the contracted dim: sum over them."""
    pa, pb = a._place, b._place
    if pa.is_atoms() != pb.is_atoms() or pa.group != pb.group:
        refuse(func, args, kwargs, "it contracts rows of different kinds (atoms and edges, or merged differently)")
    ctx = a._ctx
    if pa.is_atoms():
        if pa.kind == SHARES and pb.kind == GHOSTED or pb.kind == SHARES and pa.kind == GHOSTED:
            la, lb = a._local, b._local
        else:
            la = valid_rows(as_owned(a), pa.as_kind(OWNED), ctx)
            lb = valid_rows(as_owned(b), pb.as_kind(OWNED), ctx)
    else:
        la, lb = a._local, b._local
    return finish(func, args, comm.all_reduce(func(la, lb), ctx.group), REPLICATE, ctx)


@rule(aten.mm.default)
def mm(func, args, kwargs):
    a, b = args[0], args[1]
    pa, pb = rows_of(a), rows_of(b)
    if pa and pb:
        if pa.dim == 1 and pb.dim == 0:
            return _contract_rows(func, a, b, args, kwargs)
        refuse(func, args, kwargs, "both factors hold rows, not along the contracted dimension")
    if pa and pa.dim == 0:  # rows (merged with trailing dims or not) times features
        return finish(func, args, func(_one_factor(a), unwrap(b)), _row_place(pa), a._ctx)
    if pb and pb.dim == 1:
        return finish(func, args, func(unwrap(a), _one_factor(b)), Rows(1, _kind(pb), pb.group), b._ctx)
    refuse(func, args, kwargs, "a matrix product over the rows of one factor only (a replicated factor would be "
           "indexed by this rank's rows)")


def _one_factor(x):
    return x._local  # linear in x: shares stay shares, ghosts stay copies


def _kind(p):
    return p.kind


def _row_place(p):
    return Rows(0, p.kind, p.group)


@rule(aten.addmm.default)
def addmm(func, args, kwargs):
    bias, a, b = args[0], args[1], args[2]
    pa = rows_of(a)
    if pa and pa.dim == 0 and not rows_of(b) and not rows_of(bias) and pa.kind != SHARES:
        return finish(func, args, func(unwrap(bias), a._local, unwrap(b), **kwargs), Rows(0, pa.kind, pa.group), a._ctx)
    if pa and pa.kind == SHARES and not rows_of(b) and not rows_of(bias):
        return finish(func, args, func(unwrap(bias), as_owned(a), unwrap(b), **kwargs), Rows(0, OWNED, pa.group), a._ctx)
    refuse(func, args, kwargs, "a biased product whose rows are not the first factor's")


@rule(aten.bmm.default)
def bmm(func, args, kwargs):
    a, b = args[0], args[1]
    pa, pb = rows_of(a), rows_of(b)
    if pa and pb and pa.dim == 0 and pb.dim == 0:  # one small product per row
        if pa.is_atoms() != pb.is_atoms() or pa.group != pb.group:
            refuse(func, args, kwargs, "it multiplies rows of different kinds (atoms and edges, or merged differently)")
        if pa.kind == SHARES and pb.kind == SHARES:
            la, lb, kind = as_owned(a), as_owned(b), OWNED
        elif SHARES in (pa.kind, pb.kind):
            la = a._local if pa.kind == SHARES else as_ghosted(a)
            lb = b._local if pb.kind == SHARES else as_ghosted(b)
            kind = SHARES
        else:
            la, lb = a._local, b._local
            kind = OWNED if OWNED in (pa.kind, pb.kind) else pa.kind
        return finish(func, args, func(la, lb), Rows(0, kind, pa.group), a._ctx)
    if pa and pb and pa.dim == 2 and pb.dim == 1:
        return _contract_rows(func, a, b, args, kwargs)
    if pa and not pb and pa.dim == 1:
        return finish(func, args, func(a._local, unwrap(b)), pa, a._ctx)
    if pb and not pa and pb.dim == 2:
        return finish(func, args, func(unwrap(a), b._local), pb, b._ctx)
    # NOTE [a batch factor equal along the rows]: positions (n, 1, 3) @ lattice[node_batch] (n, 3, 3)
    # with node_batch built from a size (one system: every row the same matrix, `uniform_along`) is
    # one product per row with the same matrix: row-local, linear in the rows (shares stay shares)
    rows, other = (a, b) if pa else (b, a)
    p = pa or pb
    if p and not (pa and pb) and p.dim == 0 and other.shape[0] == rows.shape[0] and uniform_along(other, 0):
        local = (rows._local, unwrap(other)) if pa else (unwrap(other), rows._local)
        return finish(func, args, func(*local), p.plain_values(), rows._ctx)
    refuse(func, args, kwargs, "a batched product whose batch is not the rows of both factors, nor a factor equal "
           "in every batch entry", "read a per-system matrix by each row's system index (cell[batch.batch]), "
           "not by an index built from a size (a whole system's repeat_interleave of per-system counts)")


@rule(aten.baddbmm.default)
def baddbmm(func, args, kwargs):
    """``beta * input + alpha * bmm(batch1, batch2)`` (nequip's per-edge ``shift @ cell`` added to
    the position difference), spelled with the rules of bmm, mul and add."""
    inp, b1, b2 = args[0], args[1], args[2]
    beta = args[3] if len(args) > 3 else kwargs.get("beta", 1)
    alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)
    out = aten.bmm.default(b1, b2)
    if alpha != 1:
        out = aten.mul.Tensor(out, alpha)
    if beta == 0:
        return out
    return aten.add.Tensor(out, inp if beta == 1 else aten.mul.Tensor(inp, beta))


@rule(aten.mv.default)
def mv(func, args, kwargs):
    a, v = args[0], args[1]
    pa, pv = rows_of(a), rows_of(v)
    if pa and not pv and pa.dim == 0:
        return finish(func, args, func(a._local, unwrap(v)), Rows(0, pa.kind, pa.group), a._ctx)
    if pa and pv and pa.dim == 1 and pv.dim == 0:
        return _contract_rows(func, a, v, args, kwargs)
    refuse(func, args, kwargs, "a matrix-vector product over the rows of one factor only")


@rule(aten.dot.default, aten.vdot.default)
def dot(func, args, kwargs):
    a, b = args[0], args[1]
    if rows_of(a) and rows_of(b):
        return _contract_rows(func, a, b, args, kwargs)
    refuse(func, args, kwargs, "a dot product of rows with a plain vector (indexed by this rank's rows)")
