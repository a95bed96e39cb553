"""Index reads and scatters: the halo rules of message passing.

# NOTE [aten halo rules]
* A read of atom rows by an index whose values are atom rows (``x[sender]``,
  ``x.index_select(0, sender)``, ``x.gather(0, idx)``, the gradient's ``index_select``)
  needs every row the index names, ghosts included: the rows become GHOSTED first
  (shares summed into their owners, owners copied onto their ghosts: the exchanges of
  `mlipdd.shard.exchange`), then the read is local and its rows are the index's rows.
* A scatter into atom rows by such an index (``index_add``, ``scatter_add``,
  ``index_put(accumulate=True)``, and the gradient of a read) adds each edge's value into
  the row of its atom on this rank, a ghost row too: the result is SHARES, and the
  shares reach their owners only when a rule needs the value (NOTE [aten placements]).
  A plain or replicated accumulator (``torch.zeros(n, F)``) is read as atom rows:
  the index's values say that its rows are this rank's atoms.
* A read of a replicated table by rows (``embed[z]``, ``cell[batch]``) is row-local; a
  scatter by rows into a replicated table (per-system sums, per-element sums, the
  table's gradient) sums the rows that count once and all-reduces the sum.
* Any other index meets rows it cannot name (an index of plain values into rows, rows
  picked by position): refused.

# NOTE [aten sharded storage]
Under sharded storage (`mlipdd.strategy.sharded`) a rank stores its owned rows only,
and its edge index addresses ``[owned | request table]``: ``n_owned + k`` is the k-th
remote atom this rank reads (``HaloContext.reads``, an `ExchangePlan` grouped by owner).
No ghost row is stored, so every atom-row tensor is complete on its rows (GHOSTED, the
storage plan `comm.OwnedRowsOnly` makes the kind changes identities), and the two halo
rules become exchanges at the op itself:

* a read by the edge index fetches the request table from the owners (`comm.fetch`),
  indexes ``[owned | request table]`` and drops the table;
* a scatter by the edge index adds into a zero ``[owned | request table]`` and sends each
  request-table row's sum to its owner (`comm.deliver`), which adds it to its row: the
  result is complete owned rows at once (the shape of the accumulator is the owned rows,
  so shares of remote atoms cannot wait in it).

Each is the other's adjoint, and autograd reaches them through the same rules (the
gradient of a read is a scatter, NOTE [aten gradients]), so no gradient code exists here
either. Every rank issues them at the same op, whatever its index holds.
"""

from __future__ import annotations

import torch

from mlipdd.shard.aten import comm
from mlipdd.shard.aten.placement import EDGES, GHOSTED, REPLICATE, SHARES, Rows
from mlipdd.shard.aten.rules import (
    as_ghosted,
    as_owned,
    as_shares,
    finish,
    is_inplace,
    refuse,
    rows_of,
    rule,
    uniform_along,
    valid_rows,
)
from mlipdd.shard.aten.tensor import ShardTensor, unwrap

aten = torch.ops.aten


def _read_source(func, args, kwargs, x, dim, ctx):
    """x's local tensor for a read along ``dim`` by an index of atom rows: every row the
    index can name (sharded storage: the request table appended, NOTE [aten sharded storage])."""
    p = rows_of(x)
    if p is None:
        if isinstance(x, torch.Tensor) and not uniform_along(x, dim):
            refuse(func, args, kwargs, "it reads a replicated or plain tensor by atom rows: its rows are not "
                   "this rank's atoms", "read distributed atom rows (built from the model's inputs)")
        return _uniform_table(unwrap(x), dim, ctx.reads)
    if not p.is_atoms() or p.dim != dim or p.group != 1:
        refuse(func, args, kwargs, f"the index names atom rows, but the tensor holds {p} (read along dim {dim})")
    if ctx.reads is not None:
        return comm.fetch(as_ghosted(x), dim, ctx.reads)
    return as_ghosted(x)


def _uniform_table(local, dim, reads):
    """A tensor equal along its rows (``torch.ones(n, F)``) read by the edge index: under
    sharded storage its request-table rows are copies of any row, nothing is sent."""
    if reads is None or reads.n_ghost == 0 or local.dim() <= dim or local.shape[dim] != reads.n_owned \
            or reads.n_owned == 0:
        return local
    extra = list(local.shape)
    extra[dim] = reads.n_ghost
    return torch.cat([local, local.narrow(dim, 0, 1).expand(extra)], dim)


def _index_place(idx: Rows, dim: int, values=None) -> Rows:
    return Rows(dim, idx.kind, idx.group, values)  # a flattened (n, M) table: M entries per row


def _check_index(func, args, kwargs, idx):
    ip = rows_of(idx)
    if ip is None:
        refuse(func, args, kwargs, "a plain or replicated index picks rows of distributed rows: the same "
               "number is a different row on each rank", "index by the model's edge index (or a tensor built "
               "from it), never by torch.arange / positions of rows")
    return ip


@rule(aten.index_select.default)
def index_select(func, args, kwargs):
    x, dim, idx = args[0], args[1] % max(args[0].dim(), 1), args[2]
    return _read(func, args, kwargs, x, dim, idx, lambda src, i: func(src, dim, i))


def _read(func, args, kwargs, x, dim, idx, op):
    xp = rows_of(x)
    ip = rows_of(idx)
    if ip is not None and ip.values == "atoms":
        src = _read_source(func, args, kwargs, x, dim, idx._ctx)
        values = xp.values if xp else None
        return finish(func, args, op(src, idx._local), _index_place(ip, dim, values), idx._ctx)
    if xp is None:  # a replicated table read by rows of another meaning (species, systems)
        if ip.group != 1:
            refuse(func, args, kwargs, "the index's rows are merged with another dimension")
        return finish(func, args, op(unwrap(x), idx._local), Rows(dim + ip.dim, ip.kind), idx._ctx)
    if xp.dim == dim:
        _check_index(func, args, kwargs, idx if ip else None)
        refuse(func, args, kwargs, "the index's values are not atom rows (only an index built from the edge "
               "index names rows)", getattr(x._ctx, "read_fix", "read rows through the neighbour list's edge index"))
    if ip is not None:
        refuse(func, args, kwargs, "a distributed index into a dimension other than the rows")
    local = as_owned(x) if xp.kind == SHARES else x._local
    kind = "atoms-owned" if xp.kind == SHARES else xp.kind
    return finish(func, args, op(local, unwrap(idx)), xp.as_kind(kind).plain_values(), x._ctx)


@rule(aten.index.Tensor)
def index(func, args, kwargs):
    x, indices = args[0], list(args[1])
    given = [(k, i) for k, i in enumerate(indices) if i is not None]
    xp = rows_of(x)
    if len(given) == 2 and xp is not None and xp.dim == 0 and given[0][0] == 0 and _is_arange_of_rows(given[0][1], x):
        # x[torch.arange(n), j]: one entry of each row (a per-row column pick): row-local
        k, j = given[1]
        jp = rows_of(j)
        if jp is not None and (jp.dim != 0 or jp.is_atoms() != xp.is_atoms() or jp.kind == SHARES):
            refuse(func, args, kwargs, "a per-row pick by an index of other rows")
        local = as_owned(x) if xp.kind == SHARES else x._local
        kind = "atoms-owned" if xp.kind == SHARES else xp.kind
        out = func(local, [unwrap(given[0][1])] + [None] * (k - 1) + [unwrap(j)])
        return finish(func, args, out, xp.as_kind(kind).plain_values(), x._ctx)
    if len(given) != 1:
        if xp is None and not any(rows_of(i) for _, i in given):
            return _rep(func, args, kwargs)
        places = {rows_of(i) for _, i in given}
        if xp is None and [k for k, _ in given] == list(range(len(given))) and len(places) == 1:
            # table[z[snd], z[rcv]]: a replicated table read by per-row keys (D3's C6) is row-local;
            # keys that are atom row numbers (the edge index itself) name pairs of rows: refused below
            (p,) = places
            if p is not None and p.dim == 0 and p.kind != SHARES and p.values != "atoms" and \
                    len({tuple(i.shape) for _, i in given}) == 1 and given[0][1].dim() == 1:
                return finish(func, args, func(unwrap(x), [unwrap(i) for i in indices]), p.plain_values(), given[0][1]._ctx)
        if xp is not None and not any(rows_of(i) for _, i in given) and xp.dim not in [k for k, _ in given] \
                and xp.dim < min(k for k, _ in given):
            return finish(func, args, func(x._local, [unwrap(i) for i in indices]), xp.plain_values(), x._ctx)
        refuse(func, args, kwargs, "advanced indexing by several index tensors (A[rcv, snd]) addresses pairs of "
               "rows no rank holds together", "scatter per edge into atom rows instead")
    k, idx = given[0]
    if idx.dtype == torch.bool:
        return _masked(func, args, kwargs, x, k, idx)
    if idx.dim() != 1 and rows_of(idx) and rows_of(idx).values == "atoms":
        refuse(func, args, kwargs, "a multi-dimensional index of atom rows")

    def op(src, i):
        return torch.ops.aten.index.Tensor(src, [None] * k + [i])

    if idx.dim() == 1 or rows_of(idx) is None:
        return _read(func, args, kwargs, x, k, idx, op)
    ip = rows_of(idx)
    if xp is None:  # a table read by a multi-dimensional index: its rows stay where the index has them
        return finish(func, args, op(unwrap(x), idx._local), Rows(k + ip.dim, ip.kind), idx._ctx)
    refuse(func, args, kwargs, "a multi-dimensional index into distributed rows")


def _is_arange_of_rows(i, x) -> bool:
    """A plain 0..n-1 over all of x's rows (one value read)."""
    if rows_of(i) is not None or i.dim() != 1 or i.shape[0] != x.shape[0] or i.dtype == torch.bool:
        return False
    i = unwrap(i)
    return bool(torch.equal(i, torch.arange(x.shape[0], device=i.device, dtype=i.dtype)))


def _rep(func, args, kwargs):
    from mlipdd.shard.aten.rules import run_local

    return finish(func, args, run_local(func, args, kwargs), REPLICATE, _ctx(args))


def _ctx(args):
    from mlipdd.shard.aten.rules import ctx_of

    return ctx_of(args, {})


def _masked(func, args, kwargs, x, k, mask):
    """Rows kept by a boolean mask of the same rows: edges stay edges (each on one rank)."""
    xp, mp = rows_of(x), rows_of(mask)
    if xp is None or mp is None or xp.dim != k or mp.dim != 0 or mask.dim() != 1:
        if xp is not None and mp is None and xp.dim < k:
            return finish(func, args, func(x._local, [None] * k + [unwrap(mask)]), xp, x._ctx)
        refuse(func, args, kwargs, "a boolean mask that is not a mask of the tensor's rows")
    if xp.is_atoms() and mp.is_atoms():
        from mlipdd.shard.aten.global_rows import kept_by_mask  # NOTE [atom rows kept by a mask]

        return kept_by_mask(func, args, kwargs, x, mask)
    if xp.kind != EDGES or mp.kind != EDGES:
        refuse(func, args, kwargs, "it keeps a subset of atom rows: the result is no longer this rank's layout of "
               "atoms (a sum over it would count ghost copies)",
               "multiply by the mask (torch.where(mask, x, 0)) instead of selecting atom rows")
    return finish(func, args, func(x._local, [None] * k + [mask._local]), xp, x._ctx)


@rule(aten.gather.default)
def gather(func, args, kwargs):
    x, dim, idx = args[0], args[1] % max(args[0].dim(), 1), args[2]
    xp, ip = rows_of(x), rows_of(idx)
    if ip is not None and ip.values == "atoms" and ip.dim == dim:
        src = _read_source(func, args, kwargs, x, dim, idx._ctx)
        return finish(func, args, func(src, dim, idx._local), _index_place(ip, dim), idx._ctx)
    if xp is None and ip is not None:  # a table read per row
        return finish(func, args, func(unwrap(x), dim, idx._local), Rows(ip.dim, ip.kind), idx._ctx)
    if xp is not None and ip is not None and xp.dim == ip.dim and xp.dim != dim and xp.is_atoms() == (ip.kind != EDGES):
        local = as_owned(x) if xp.kind == SHARES else x._local
        kind = "atoms-owned" if xp.kind == SHARES else xp.kind
        return finish(func, args, func(local, dim, idx._local), xp.as_kind(kind).plain_values(), x._ctx)
    refuse(func, args, kwargs, "a gather whose index is not rows of the same kind")


@rule(aten.embedding.default)
def embedding(func, args, kwargs):
    weight, idx = args[0], args[1]
    ip = rows_of(idx)
    if rows_of(weight) is not None or ip is None:
        refuse(func, args, kwargs, "an embedding whose table is distributed")
    if ip.values == "atoms":
        refuse(func, args, kwargs, "an embedding indexed by atom row NUMBERS (an edge index): they are this "
               "rank's local row numbers, not the atoms' numbers in one process",
               "index a table by a property of the atoms (species), or read atom rows by the edge index")
    return finish(func, args, func(unwrap(weight), idx._local, *args[2:], **kwargs), Rows(ip.dim, ip.kind), idx._ctx)


@rule(aten.embedding_dense_backward.default)
def embedding_backward(func, args, kwargs):
    grad, idx = args[0], args[1]
    gp, ip = rows_of(grad), rows_of(idx)
    if gp is None or ip is None or gp.dim != ip.dim:
        refuse(func, args, kwargs, "an embedding gradient that is not per row")
    g = valid_rows(as_owned(grad) if gp.kind == SHARES else grad._local, gp.as_kind("atoms-owned") if gp.is_atoms() else gp, grad._ctx)
    i = valid_rows(idx._local, ip.as_kind("atoms-owned") if ip.is_atoms() else ip, idx._ctx)
    out = func(g, i, *args[2:], **kwargs)
    return finish(func, args, comm.all_reduce(out, grad._ctx.group), REPLICATE, grad._ctx)


# ---- scatters ---------------------------------------------------------------------------
def _scatter(func, args, kwargs, target, dim, idx, src, op, fix_index=None):
    """``op(target_local, idx_local, src_local)`` is the local scatter (out of place or in
    place on the first argument); NOTE [aten halo rules]."""
    ip, sp, tp = rows_of(idx), rows_of(src), rows_of(target)
    if ip is None and _uniform_index_of_rows(idx, src, dim, target):
        idx = ShardTensor(unwrap(idx), Rows(sp.dim, sp.kind, sp.group), src._ctx, "a uniform index")
        ip = rows_of(idx)  # NOTE [a uniform index of rows]
    if ip is None:
        refuse(func, args, kwargs, "a scatter by a plain index into or from distributed rows",
               "scatter by an index built from the distributed rows (batch.batch for each row's system, the edge "
               "index), not from a size (torch.zeros(n, dtype=long) is one system's index only while every row "
               "holds the same value)")
    if idx.dtype == torch.bool:  # a mask picks rows of its own kind, never rows of a table
        refuse(func, args, kwargs, "a scatter by a boolean mask of distributed rows",
               "write by a mask of the target's own rows (x[mask] = v), or multiply by the mask")
    if sp is not None and (sp.kind == EDGES) != (ip.kind == EDGES):
        refuse(func, args, kwargs, "the index and the scattered values hold different rows")
    ctx = idx._ctx
    if ip.values == "atoms":  # into atom rows: shares
        if tp is not None and (not tp.is_atoms() or tp.dim != dim or tp.group != 1):
            refuse(func, args, kwargs, f"the index names atom rows, but the target holds {tp}")
        if tp is None and is_inplace(func) and not isinstance(target, ShardTensor):
            refuse(func, args, kwargs, "an in-place scatter into atom rows of a plain tensor (torch.zeros(n, F)"
                   ".index_add_): the plain tensor cannot carry the rows' placement",
                   "write it out of place (acc = torch.zeros(n, F).index_add(0, receiver, messages)), or create "
                   "the accumulator from the rows (torch.zeros_like(h), h.new_zeros(n, F) also works out of place)")
        base = as_shares(target) if tp is not None else _plain_as_shares(unwrap(target), dim, ctx)
        i, s = _scattered_rows(idx, src, ip, sp, ctx)
        if ctx.reads is not None:
            return _scatter_delivered(func, args, target, dim, base, op, i, s, ctx)
        if is_inplace(func) and isinstance(target, ShardTensor):
            if base is not target._local:
                target._local.copy_(base)
            op(target._local, i, s)
            return finish(func, args, target._local, Rows(dim, SHARES), ctx)
        return finish(func, args, op(base, i, s), Rows(dim, SHARES), ctx)
    # by rows of another meaning (systems, species) into a replicated table: a sum over the rows
    if tp is not None:
        refuse(func, args, kwargs, f"the index's values are not atom rows, but the target holds {tp}",
               "scatter by the edge index into atom rows, or by system / species into a replicated table")
    i, s = _valid_pair(idx, src, ip, sp, ctx)
    base = unwrap(target)
    delta = comm.all_reduce(op(torch.zeros_like(base), i, s), ctx.group)
    if is_inplace(func):
        base.add_(delta)
        if isinstance(target, ShardTensor):
            return target
        return target
    return finish(func, args, base + delta, REPLICATE, ctx)


# NOTE [a uniform index of rows]
# A plain or replicated index with the same value in every row (``torch.zeros(n, dtype=long)``,
# one system's ``node_batch`` built from a size) reads a replicated table row-locally
# (``lattice[node_batch]``: each row the same value, as in one process; `uniform_along`). Its
# adjoint, the scatter of per-row values into the table by that index (autograd's
# ``index_put(accumulate=True)``, matgl TensorNet's cell gradient), adds every row at the one
# entry: a sum over the rows, so it takes the per-system rule (the rows that count once, summed
# and all-reduced) with the index read as rows of the values. An index whose rows differ is
# this rank's rows in no sense (refused as before).
def _uniform_index_of_rows(idx, src, dim, target) -> bool:
    """NOTE [a uniform index of rows]: ``idx`` plain, aligned with ``src``'s rows along ``dim``
    and the same in every row, ``target`` a replicated table."""
    sp = rows_of(src)
    if sp is None or rows_of(target) is not None or sp.dim != dim or not isinstance(idx, torch.Tensor) \
            or idx.dtype == torch.bool or idx.dim() <= dim:
        return False
    return idx.shape[dim] == src.shape[dim] and uniform_along(idx, dim)


def _scatter_delivered(func, args, target, dim, base, op, i, s, ctx):
    """Sharded storage: the scatter into a zero ``[owned | request table]``, each remote
    row's sum delivered to its owner (NOTE [aten sharded storage]); complete owned rows."""
    shape = list(base.shape)
    shape[dim] = ctx.reads.n_padded
    delivered = comm.deliver(op(base.new_zeros(shape), i, s), dim, ctx.reads)
    place = Rows(dim, GHOSTED)
    if is_inplace(func) and isinstance(target, ShardTensor):
        if base is not target._local:
            target._local.copy_(base)
        target._local.add_(delivered)
        return finish(func, args, target._local, place, ctx)
    return finish(func, args, base + delivered, place, ctx)


def _plain_as_shares(base, dim, ctx):
    if base.shape[dim] != ctx.n_padded:
        raise _SizeMismatch(dim, base.shape, ctx.n_padded)
    return comm.zero_ghosts(base, dim, ctx.plan)


class _SizeMismatch(ValueError):
    def __init__(self, dim, shape, n):
        super().__init__(f"a scatter into atom rows along dim {dim} of a tensor shaped {tuple(shape)}, but this rank "
                         f"holds {n} atom rows: an accumulator sized by a count of the whole system (torch.zeros("
                         "sum(num_atoms), 3), as sevenn's ForceStressOutputFromEdge does for its forces from edge "
                         "gradients), whose row numbers are one process's, not this rank's; create the accumulator "
                         "with the rows' size (torch.zeros_like(pos), h.new_zeros(h.shape[0], F)), or take the forces "
                         "as the energy's gradient with respect to the positions")


def _narrowed(t, dim, full, n):
    """``t`` narrowed to its first ``n`` rows along ``dim`` when it holds ``full`` rows there."""
    if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == full:
        return t.narrow(dim, 0, n)
    return t


def _scattered_rows(idx, src, ip, sp, ctx):
    """The index and values of the rows that count once: every row of edges and of shares,
    the owned rows of per-atom rows (their ghost rows are copies, or hold nothing)."""
    if sp is not None and sp.kind == SHARES:
        return idx._local, src._local
    i, s = idx._local, unwrap(src)
    if not ip.is_atoms():
        return i, s
    full, n = i.shape[ip.dim], ctx.n_owned * ip.group  # a flattened (n, M) table: M entries per atom
    sdim = sp.dim if sp is not None else ip.dim
    return i.narrow(ip.dim, 0, n), _narrowed(s, sdim, full, n)


_valid_pair = _scattered_rows


@rule(aten.index_add.default, aten.index_add_.default)
def index_add(func, args, kwargs):
    target, dim, idx, src = args[0], args[1] % max(args[0].dim(), 1), args[2], args[3]
    alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
    inplace = is_inplace(func)

    def op(t, i, s):
        return t.index_add_(dim, i, s, alpha=alpha) if inplace else torch.ops.aten.index_add(t, dim, i, s, alpha=alpha)

    sp = rows_of(src)
    if sp is not None and sp.dim != dim and rows_of(idx) is None:
        return _index_add_within_rows(func, args, kwargs, target, src, op, dim, idx)
    if sp is not None and sp.dim != dim:
        refuse(func, args, kwargs, "the scattered values' rows are not along the scatter dimension")
    try:
        return _scatter(func, args, kwargs, target, dim, idx, src, op)
    except _SizeMismatch as exc:
        refuse(func, args, kwargs, str(exc))


def _index_add_within_rows(func, args, kwargs, target, src, op, dim, idx):
    """An index_add along another dim than the rows, by a plain index (the gradient of
    ``x[:, [0, 2]]``): each row on its own, linear (shares into a zero target stay shares)."""
    sp, tp = rows_of(src), rows_of(target)
    if tp is None and not uniform_along(target, sp.dim):
        refuse(func, args, kwargs, "it adds rows into a plain tensor with its own value per row")
    if tp is not None and (tp.dim != sp.dim or tp.group != sp.group or tp.is_atoms() != sp.is_atoms()):
        refuse(func, args, kwargs, "it adds rows into a tensor of other rows")
    kinds = {sp.kind} if tp is None else {sp.kind, tp.kind}
    if len(kinds) == 1:
        kind, base, values = sp.kind, unwrap(target), src._local
    else:  # mixed atom kinds: both as complete owned rows
        kind = "atoms-owned"
        base = as_owned(target)
        values = as_owned(src)
    if is_inplace(func) and isinstance(target, ShardTensor) and base is not target._local:
        target._local.copy_(base)
        base = target._local
    return finish(func, args, op(base, unwrap(idx), values), Rows(sp.dim, kind, sp.group), src._ctx)


@rule(aten.scatter_add.default, aten.scatter_add_.default, aten.scatter_reduce.two, aten.scatter_reduce_.two)
def scatter_add(func, args, kwargs):
    target, dim, idx, src = args[0], args[1] % max(args[0].dim(), 1), args[2], args[3]
    inplace = is_inplace(func)
    if func.overloadpacket in (aten.scatter_reduce, aten.scatter_reduce_):
        reduce = args[4] if len(args) > 4 else kwargs.get("reduce")
        include_self = kwargs.get("include_self", args[5] if len(args) > 5 else True)
        ip = rows_of(idx)
        if reduce == "mean" and ip is not None and ip.values == "atoms" and ip.dim == dim:
            from mlipdd.shard.aten.scatter_means import scatter_reduce  # NOTE [aten scatter means]

            return scatter_reduce(func, args, kwargs, target, dim, idx, src, reduce, include_self)
        if reduce != "sum" or not include_self:
            refuse(func, args, kwargs, f"scatter_reduce with reduce={reduce!r}, include_self={include_self}: only "
                   "sums into rows, and means into atom rows by the edge index, have a rule (a max needs every rank's "
                   "values of an atom at once)",
                   "use scatter_add / index_add (a sum), or a sum and a count")
    ip = rows_of(idx)
    if ip is not None and ip.dim != dim:  # a scatter within each row (along another dim)
        tp = rows_of(target)
        if tp is None or tp.dim != ip.dim or (rows_of(src) and rows_of(src).dim != ip.dim):
            refuse(func, args, kwargs, "a scatter along a dimension other than the rows, into a tensor of other rows")
        local = as_owned(target) if tp.kind == SHARES else target._local
        out = func(local, dim, idx._local, as_owned(src) if rows_of(src) and rows_of(src).kind == SHARES else unwrap(src),
                   *args[4:], **kwargs)
        kind = "atoms-owned" if tp.kind == SHARES else tp.kind
        return finish(func, args, out, tp.as_kind(kind).plain_values(), target._ctx)

    def op(t, i, s):
        if inplace:
            return t.scatter_add_(dim, i, s)
        return torch.ops.aten.scatter_add(t, dim, i, s)

    try:
        return _scatter(func, args, kwargs, target, dim, idx, src, op)
    except _SizeMismatch as exc:
        refuse(func, args, kwargs, str(exc))


@rule(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
def index_put(func, args, kwargs):
    target, indices, values = args[0], list(args[1]), args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    given = [(k, i) for k, i in enumerate(indices) if i is not None]
    tp = rows_of(target)
    if len(given) == 1 and given[0][1].dtype == torch.bool and tp is not None and rows_of(given[0][1]) == tp \
            and given[0][0] == tp.dim:
        return _masked_write(func, args, kwargs, target, indices, values)
    if len(given) == 1 and given[0][1].dtype == torch.bool:
        return _masked_into_plain(func, args, kwargs, target, given[0], values, accumulate)
    if len(given) == 2 and given[0][0] == 0 and _is_arange_of_rows(given[0][1], target) and rows_of(values) \
            and rows_of(values).dim == 0 and (tp is None or tp.dim == 0):
        return _per_row_write(func, args, kwargs, target, indices, values, accumulate)
    if not accumulate or len(given) != 1 or given[0][0] != 0:
        refuse(func, args, kwargs, "an indexed write into or by distributed rows (x[i] = v, A[rcv, snd] = v) "
               "writes rows by number: the same number is a different row on each rank",
               "accumulate per edge into atom rows (index_add / index_put(..., accumulate=True) by the edge index)")
    idx = given[0][1]
    inplace = is_inplace(func)
    vp = rows_of(values)
    if vp is not None and vp.dim != 0:
        refuse(func, args, kwargs, "the written values' rows are not along the indexed dimension")

    def op(t, i, s):
        if inplace:
            return t.index_put_([i], s, accumulate=True)
        return torch.ops.aten.index_put(t, [i], s, True)

    try:
        return _scatter(func, args, kwargs, target, 0, idx, values, op)
    except _SizeMismatch as exc:
        refuse(func, args, kwargs, str(exc))


def _per_row_write(func, args, kwargs, target, indices, values, accumulate):
    """x[torch.arange(n), j] = v (or +=): one entry of each row, the adjoint of the per-row
    pick: row-local, of the values' kind."""
    vp, tp = rows_of(values), rows_of(target)
    kind = vp.kind
    if tp is None:
        base = unwrap(target)
        if not uniform_along(base, 0):
            refuse(func, args, kwargs, "a per-row write into a plain tensor with its own value per row")
        base = comm.zero_ghosts(base, 0, values._ctx.plan) if kind == SHARES else base
    elif tp.kind == kind or (kind != SHARES and tp.kind != SHARES):
        base = target._local
        kind = kind if tp.kind == kind else "atoms-owned"
    else:
        base, vals = as_owned(target), as_owned(values)
        kind = "atoms-owned"
    vals = values._local if kind == vp.kind else as_owned(values)
    plain_idx = [unwrap(i) if i is not None else None for i in indices]
    if is_inplace(func):
        if isinstance(target, ShardTensor):
            if base is not target._local:
                target._local.copy_(base)
            target._local.index_put_(plain_idx, vals, accumulate)
            return finish(func, args, target._local, Rows(0, kind), values._ctx)
        refuse(func, args, kwargs, "an in-place per-row write into a plain tensor")
    out = torch.ops.aten.index_put(base, plain_idx, vals, accumulate)
    return finish(func, args, out, Rows(0, kind), values._ctx)


def _masked_into_plain(func, args, kwargs, target, given, values, accumulate):
    """``torch.zeros(E).index_put_([mask], v)``, with ``mask`` a mask of edge rows: the
    gradient of ``e[mask]`` (autograd's ``index_backward`` starts from a plain zeros of
    the rows' shape). A target equal along the rows takes the mask's rows: row-local."""
    k, mask = given
    tp, mp, vp = rows_of(target), rows_of(mask), rows_of(values)
    if tp is not None or mp is None or mp.kind != EDGES or mp.dim != 0 or mask.dim() != 1 \
            or target.shape[k] != mask.shape[0] or not uniform_along(target, k) \
            or (vp is not None and (vp.kind != EDGES or vp.dim != k)):
        refuse(func, args, kwargs, "an indexed write by a boolean mask that is not a mask of the target's rows",
               "select and write rows by a mask of the same rows (x[mask] = v, with x and mask the same edges)")
    plain = [None] * k + [mask._local]
    local = unwrap(target)
    if is_inplace(func):
        if not isinstance(target, ShardTensor):
            refuse(func, args, kwargs, "an in-place masked write into a plain tensor")
        local.index_put_(plain, unwrap(values), accumulate)
        return finish(func, args, local, Rows(k, EDGES), mask._ctx)
    out = torch.ops.aten.index_put(local, plain, unwrap(values), accumulate)
    return finish(func, args, out, Rows(k, EDGES), mask._ctx)


def _masked_write(func, args, kwargs, target, indices, values):
    """x[mask] = v with the mask of x's own rows: row-local."""
    tp = rows_of(target)
    if tp.kind == SHARES:
        target._local.copy_(as_owned(target))
        tp = tp.as_kind("atoms-owned")
    vp = rows_of(values)
    if vp is not None and (vp.kind == SHARES or vp.is_atoms() != tp.is_atoms()):
        refuse(func, args, kwargs, "a masked write of rows of another kind")
    if vp is None and isinstance(values, torch.Tensor) and values.dim() > 0 and values.shape[0] != 1 \
            and values.stride(0) != 0:
        refuse(func, args, kwargs, "a masked write of per-row values of a plain tensor")
    from mlipdd.shard.aten.rules import run_local

    out = run_local(func, args, kwargs)
    return finish(func, args, out if not is_inplace(func) else target._local, tp.plain_values(), target._ctx)


@rule(aten.bincount.default)
def bincount(func, args, kwargs):
    x = args[0]
    xp = rows_of(x)
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
    if xp is None or xp.dim != 0:
        refuse(func, args, kwargs, "bincount of a plain tensor next to distributed rows")
    ctx = x._ctx
    if xp.values == "atoms":  # a count per atom (a degree): this rank's share of every atom row
        if minlength > ctx.n_padded:
            refuse(func, args, kwargs, f"bincount(minlength={minlength}) of atom rows, more than this rank's "
                   f"{ctx.n_padded} atom rows", "give minlength=x.shape[0] of the atom rows, or none")
        w = unwrap(weights) if weights is not None else torch.ones((), dtype=torch.long).expand(x.shape)
        if weights is not None and rows_of(weights) and rows_of(weights).kind == SHARES:
            refuse(func, args, kwargs, "bincount weighted by shares of atom rows")
        size = ctx.n_padded if ctx.reads is None else ctx.reads.n_padded
        base = torch.zeros(size, dtype=w.dtype if weights is not None else torch.long, device=x.device)
        counts = base.index_add(0, x._local, w)
        if ctx.reads is not None:  # sharded storage: each remote atom's count to its owner
            return finish(func, args, comm.deliver(counts, 0, ctx.reads), Rows(0, GHOSTED), ctx)
        return finish(func, args, counts, Rows(0, SHARES), ctx)
    i = valid_rows(x._local, xp.as_kind("atoms-owned") if xp.is_atoms() else xp, ctx)
    w = None
    if weights is not None:
        wp = rows_of(weights)
        w = valid_rows(as_owned(weights) if wp.kind == SHARES else weights._local,
                       wp.as_kind("atoms-owned") if wp.is_atoms() else wp, ctx)
    length = int(i.max()) + 1 if i.numel() else 0
    length = int(comm.all_reduce(torch.tensor([max(length, minlength)]), ctx.group, torch.distributed.ReduceOp.MAX))
    out = torch.bincount(i, w, minlength=length)
    return finish(func, args, comm.all_reduce(out, ctx.group), REPLICATE, ctx)




@rule(aten._sparse_coo_tensor_with_dims_and_tensors.default)
def sparse_from_rows(func, args, kwargs):
    """A sparse atoms x atoms matrix built from the edge index (``torch.sparse_coo_tensor(
    stack([receiver, sender]), w, (n, n))``): its columns would be this rank's local row
    numbers, and under sharded storage a remote column has no row of the matrix. Its
    product with atom rows is a scatter, which has the exact rule: refused with that."""
    refuse(func, args, kwargs, "it builds a sparse matrix whose indices are distributed rows (an atoms x atoms "
           "adjacency from the edge index): its rows and columns are this rank's local atom rows",
           "write the product as a scatter: torch.zeros_like(x).index_add(0, receiver, w[:, None] * x[sender])")
