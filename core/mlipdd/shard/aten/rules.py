"""The dispatch of the aten-level ShardTensor: one lookup, rules by aten op.

# NOTE [aten precedence]
`dispatch` looks a rule up in this order, and nowhere else:

1. no argument holds distributed rows (only replicated ShardTensors and plain
   tensors): the op runs on the local tensors, its tensors are replicated;
2. a rule registered for the exact overload (``aten.sum.dim_IntList``), then for
   the op (``aten.sum``), by `rule` below and in `mlipdd.shard.aten.index_rules`;
3. an op of the row-local table (`mlipdd.shard.aten.row_local`), or one the user
   declared row-local: the row-local rule;
4. anything else: refused (NOTE [refuse by default]).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils._mode_utils import no_dispatch

from mlipdd.shard.aten import comm
from mlipdd.shard.aten.placement import EDGES, GHOSTED, OWNED, REPLICATE, SHARES, Rows
from mlipdd.shard.aten.row_local import COPIES, LINEAR, is_row_local
from mlipdd.shard.aten.tensor import AtenRefusal, ShardTensor, unwrap

aten = torch.ops.aten
RULES: dict = {}


def rule(*ops):
    def register(fn):
        for op in ops:
            RULES[op] = fn
        return fn

    return register


def op_name(func) -> str:
    return str(func).replace("aten.", "aten::", 1) if str(func).startswith("aten.") else str(func)


# ---- helpers -----------------------------------------------------------------------------
def flat_args(args, kwargs):
    """The call's arguments, list and tuple arguments opened (aten schemas nest no deeper);
    a plain loop: pytree costs more than most rules."""
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
    for a in kwargs.values():
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def shards(args, kwargs):
    return [a for a in flat_args(args, kwargs) if isinstance(a, ShardTensor)]


def _unwrap_arg(a):
    if isinstance(a, ShardTensor):
        return a._local
    if isinstance(a, (list, tuple)):
        return type(a)(x._local if isinstance(x, ShardTensor) else x for x in a)
    return a


def rows_of(x):
    """``x``'s placement when it holds distributed rows, else None."""
    if isinstance(x, ShardTensor) and isinstance(x._place, Rows):
        return x._place
    return None


def is_inplace(func) -> bool:
    name = func.overloadpacket.__name__
    return name.endswith("_") and not name.endswith("__")


def refuse(func, args, kwargs, why: str, fix: str = ""):
    tensors = [a for a in flat_args(args, kwargs) if isinstance(a, torch.Tensor)]
    described = []
    for t in tensors[:4]:
        if isinstance(t, ShardTensor):
            described.append(f"{t._place} {tuple(t.shape)} from `{t._origin}`")
        else:
            described.append(f"plain {tuple(t.shape)}")
    if not fix and getattr(func, "namespace", "aten") not in ("aten", "prims"):  # a custom op: its adapter
        fix = (f"give `{op_name(func.overloadpacket)}` an OpAdapter in the spec "
               "(DistributionSpec.custom_ops: which arguments are atom rows, which outputs are per atom "
               "or summed), so the dispatch knows what crosses ranks")
    fix = fix or default_fix(func)
    raise AtenRefusal(
        f"mlipdd aten dispatch refuses `{op_name(func)}` on distributed rows: {why}. "
        f"Arguments: {'; '.join(described)}. Fix: {fix}."
    )


# NOTE [the fix a refusal names]
# `declare_row_local` makes an op run through the row-local rule: operands aligned on the
# rows, each output row from the same input rows, elementwise. Suggested for an op that is
# elementwise in kind (torch tags it ``pointwise``: ``aten::rad2deg``, ``aten::special_*``),
# has no rule of its own (a rule takes precedence, NOTE [aten precedence]: a declaration
# would change nothing) and is not row-local already. For any other op the declaration
# would be a wrong answer (``aten::scatter_`` writes rows by an index's values, ``cumsum``
# runs along a dim, which may be the rows): the fix then names the ops to rewrite with,
# and for index writes the ones that add.
_REWRITE = ("rewrite the step with ops that have a rule (index_select / index_add / scatter_add by the edge "
            "index, sums over the rows, row-local math)")


def default_fix(func) -> str:
    """NOTE [the fix a refusal names]: the fix of a refusal that names none, by the op's kind."""
    name = op_name(func.overloadpacket)
    if _declarable(func):
        return (f"{_REWRITE}, or, since `{name}` is elementwise, if it truly acts on each row alone, declare it: "
                f"mlipdd.shard.aten.declare_row_local('{name}')")
    if any(word in func.overloadpacket.__name__ for word in ("scatter", "index", "put", "gather", "take")):
        return ("read rows by the edge index (x[sender], index_select, gather) and add into atom rows "
                "(index_add, scatter_add, index_put(..., accumulate=True)); a write that overwrites rows by "
                "an index (scatter, index_copy, index_fill) has no cross-rank rule")
    return _REWRITE


def _declarable(func) -> bool:
    return (torch.Tag.pointwise in getattr(func, "tags", ()) and not is_row_local(func)
            and func not in RULES and func.overloadpacket not in RULES)


def ctx_of(args, kwargs):
    for s in shards(args, kwargs):
        return s._ctx
    return None


def wrap_out(out, place, ctx, origin):
    """Wrap every tensor of ``out`` with ``place`` (one placement, or a list per element)."""
    if isinstance(out, torch.Tensor):
        return ShardTensor(out, place, ctx, origin)
    if isinstance(out, (tuple, list)):
        places = place if isinstance(place, list) else [place] * len(out)
        return type(out)(wrap_out(o, p, ctx, origin) for o, p in zip(out, places))
    return out


def finish(func, args, out_local, place, ctx):
    """The op's result: in place, the first argument with its new placement and local."""
    origin = op_name(func.overloadpacket)
    if is_inplace(func) and isinstance(args[0], ShardTensor):
        args[0]._place = place
        args[0]._origin = origin
        return same_shape_as_local(args[0])
    return wrap_out(out_local, place, ctx, origin)


def same_shape_as_local(x: ShardTensor) -> ShardTensor:
    """After an in-place view op (``squeeze_``, which ``vector @ matrix`` issues after its
    ``mm``; ``unsqueeze_``, ``t_``, ``transpose_``) the local tensor has its new shape, the
    wrapper still the old one, and every later op would read the old one: set the
    wrapper's sizes and strides to the local's (below the dispatch: metadata only)."""
    local = x._local
    if x.shape != local.shape or x.stride() != local.stride():
        with no_dispatch():
            x.as_strided_(local.size(), local.stride(), local.storage_offset())
    return x


def run_local(func, args, kwargs):
    return func(*[_unwrap_arg(a) for a in args], **{k: _unwrap_arg(v) for k, v in kwargs.items()})


# ---- the representation changes (each a halo exchange or a copy) --------------------------
def as_ghosted(x: ShardTensor) -> torch.Tensor:
    """x's local rows with every ghost row its owner's value."""
    p = x._place
    local = x._local
    if p.kind == GHOSTED:
        return local
    if p.kind == SHARES:
        local = comm.accumulate(local, p.dim, x._ctx.plan, p.group)
    return comm.fill(local, p.dim, x._ctx.plan, p.group)


def as_owned(x: ShardTensor) -> torch.Tensor:
    p = x._place
    if p.kind == SHARES:
        return comm.accumulate(x._local, p.dim, x._ctx.plan, p.group)
    return x._local


def as_shares(x: ShardTensor) -> torch.Tensor:
    p = x._place
    if p.kind == SHARES:
        return x._local
    return comm.zero_ghosts(x._local, p.dim, x._ctx.plan, p.group)


def valid_rows(local: torch.Tensor, place: Rows, ctx) -> torch.Tensor:
    """The local rows that count each row of the global tensor once: owned rows of a
    GHOSTED / OWNED tensor, every row of SHARES and of edge rows."""
    if place.kind in (GHOSTED, OWNED):
        return local.narrow(place.dim, 0, ctx.n_owned * place.group)
    return local


def uniform_along(t, dim: int) -> bool:
    """A replicated/plain operand that does not differ between rows along ``dim``: absent,
    size 1, expanded (stride 0) there, or (one read of the values) equal along it, as a
    ``torch.zeros(n, F)`` of this rank's row count is: its ghost rows then equal their
    owners' rows, whatever the values. One with row-dependent values (``torch.arange(n)``)
    is refused by the caller."""
    if dim < 0 or t.shape[dim] <= 1 or t.stride(dim) == 0:
        return True
    local = unwrap(t)
    return bool((local == local.narrow(dim, 0, 1)).all())


# ---- dispatch ---------------------------------------------------------------------------
def dispatch(func, args, kwargs):
    """NOTE [aten precedence]."""
    found = shards(args, kwargs)
    if found and func.overloadpacket in _ARITHMETIC:
        refuse_local_counts(func, args, kwargs, found[0]._ctx)
    if not any(rows_of(s) for s in found):
        return _replicated(func, args, kwargs)
    fn = RULES.get(func) or RULES.get(func.overloadpacket)
    if fn is not None:
        return fn(func, args, kwargs)
    if is_row_local(func):
        return row_local(func, args, kwargs)
    return refuse(func, args, kwargs, "no rule for this op")


def laid_out_for_the_whole_system(n_entries: int, n_rows: int) -> tuple[str, str]:
    """Why and fix of a plain operand with a whole system's rows meeting this rank's rows."""
    why = (f"a replicated or plain operand has {n_entries} entries along the row dimension, where this rank "
           f"holds {n_rows} rows: it is laid out for the whole system, as one process holds it "
           "(torch.repeat_interleave(per_system, atoms_per_system), a size read from a global count), not for "
           "this rank's rows")
    fix = ("read per-system values by each row's system index (per_system[batch.batch]), and build per-row "
           "tensors from the distributed ones (torch.zeros_like(x))")
    return why, fix


def _replicated(func, args, kwargs):
    ctx = ctx_of(args, kwargs)
    try:
        out = run_local(func, args, kwargs)
    except (IndexError, RuntimeError, ValueError) as exc:
        if isinstance(exc, (AtenRefusal, torch.OutOfMemoryError)):  # not a layout problem
            raise
        equal_rows = _uniform_expanded(func, args, kwargs)
        if equal_rows is not None:
            return wrap_out(equal_rows, REPLICATE, ctx, op_name(func.overloadpacket))
        # NOTE [failed on replicated values]: no argument holds rows, so the op ran on this
        # rank's values as they are; torch's own error would name neither the op nor the cause
        raise AtenRefusal(
            f"`{op_name(func)}` failed on this rank ({type(exc).__name__}: {exc}); none of its arguments holds "
            "distributed rows, so it ran on this rank's replicated and plain values as they are: a size or an "
            "index built for the whole system (a global atom count, a cumsum of per-system counts, "
            "torch.arange(n_atoms)) does not fit this rank's rows. Fix: build per-row tensors from the "
            "distributed ones (batch.batch for each row's system, torch.zeros_like(x), x.shape[0] of the rows)"
        ) from exc
    if is_inplace(func) and isinstance(args[0], ShardTensor):
        return same_shape_as_local(args[0])
    if isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out)):
        return wrap_out(out, REPLICATE, ctx, op_name(func.overloadpacket))
    return out


# NOTE [an expand of equal rows]: orb's segment sums expand their segment ids, built from a whole
# system's counts (``repeat_interleave(arange(n_graphs), n_node)``: one value per atom of the
# system), to the data's rows (``segment_ids.expand_as(data)``), which hold this rank's rows: torch
# stops at the size mismatch. With one value in every row (one system), the ids read the same for
# any count of rows, and the expand to this rank's rows is what one process's expand holds on
# them: exact, for values without a gradient (the adjoint would sum this rank's rows into the
# whole system's). Rows that differ stay torch's error, wrapped below.
def _uniform_expanded(func, args, kwargs):
    if func is not aten.expand.default or not isinstance(args[0], torch.Tensor) or args[0].requires_grad:
        return None
    x, sizes = unwrap(args[0]), list(args[1])
    lead = len(sizes) - x.dim()
    for d in range(x.dim()):
        want = sizes[lead + d]
        if want != -1 and x.shape[d] not in (1, want):
            if not uniform_along(x, d):
                return None
            x = x.narrow(d, 0, 1)
    return x.expand(sizes)


# ---- row-local ops ----------------------------------------------------------------------
def row_local(func, args, kwargs):
    """Operands aligned on one row dimension (broadcast like torch), one kind of rows;
    shares summed first unless the op is linear in them."""
    added = _plain_addend_as_shares(func, args, kwargs)
    if added is not None:
        func, args = added
    original = args
    tensors = [a for a in flat_args(args, kwargs) if isinstance(a, torch.Tensor)]
    ndim = max(t.dim() for t in tensors)
    rows = [t for t in tensors if rows_of(t)]
    ctx = rows[0]._ctx
    first = rows[0]._place
    out_dim = first.dim + ndim - rows[0].dim()
    for t in rows:
        p = t._place
        if p.dim + ndim - t.dim() != out_dim or p.group != first.group:
            refuse(func, args, kwargs, "its operands hold rows along different dimensions",
                   "move the rows to the same dimension (transpose / unsqueeze) before combining")
        if p.is_atoms() != first.is_atoms():
            refuse(func, args, kwargs, "it combines atom rows with edge rows",
                   "read the atom rows for each edge first (x.index_select(0, sender))")
    n_rows = rows[0].shape[first.dim]
    for t in tensors:
        along = out_dim - (ndim - t.dim())
        if not rows_of(t) and along >= 0 and t.shape[along] not in (1, n_rows):
            # torch would stop with a bare size mismatch (on the ranks whose count differs)
            refuse(func, args, kwargs, *laid_out_for_the_whole_system(t.shape[along], n_rows))
        if not rows_of(t) and not uniform_along(t, along):
            refuse(func, args, kwargs, "a replicated or plain operand has one value per row: its rows are not "
                   "distributed, so they cannot be this rank's rows",
                   "build it from the distributed tensors (torch.zeros_like(x), x[sender], ...), not from "
                   "a size (torch.arange(x.shape[0]))")
    if func.overloadpacket not in COPIES and any(t._place.values == "atoms" for t in rows) \
            and not _same_row_test(func, tensors, rows):
        refuse(func, args, kwargs, "it computes with atom row NUMBERS (an edge index's values): they are this "
               "rank's local row numbers, not the atoms' numbers in one process (sender < receiver, "
               "receiver * n + sender)", "use the edge index only to read and scatter rows; compare atoms by "
               "a property they carry (positions, atom_ids passed as a float input)")
    kinds = {t._place.kind for t in rows}
    if not first.is_atoms():
        kind, convert = EDGES, None
    elif SHARES in kinds and _linear_in_shares(func, args, tensors, rows):
        kind = SHARES
        convert = as_shares if func.overloadpacket.__name__.rstrip("_") in ("add", "sub", "rsub") else _factor
    else:
        kind = OWNED if kinds & {OWNED, SHARES} else GHOSTED
        convert = as_owned
    if convert is not None:
        if is_inplace(func) and isinstance(args[0], ShardTensor) and rows_of(args[0]):
            fresh = convert(args[0])
            if fresh is not args[0]._local:
                args[0]._local.copy_(fresh)
        skip = args[0] if is_inplace(func) else None

        def conv(a):
            if isinstance(a, (list, tuple)):
                return type(a)(conv(x) for x in a)
            return convert(a) if a is not skip and rows_of(a) else a

        args = [conv(a) for a in args]
        kwargs = {k: conv(v) for k, v in kwargs.items()}
    out = run_local(func, args, kwargs)
    values = first.values if func.overloadpacket in COPIES else None
    place = Rows(out_dim, kind, first.group, values)
    if isinstance(out, torch.Tensor) and out.dim() != ndim:  # an op that reduced (rare in the table)
        refuse(func, args, kwargs, "its result does not keep the operands' dimensions")
    return finish(func, original, out, place, ctx)


# NOTE [shares plus a replicated value]
# Stress comes from the strain route. Where ghost rows sit at their IMAGES (owner + lattice
# shift: a model that builds its own graph, NOTE [ghosts as copies]; elsewhere the shift is on
# the edges and reaches the virial through the cell), the virial is the
# contraction of those rows with the energy's gradient by row, ghost rows included: the
# gradient's SHARES are the partial derivatives by row (an edge's pull on a ghost image
# belongs to that image, and its lattice shift is what the cell term of the stress needs).
# Summing the shares into their owners first keeps every atom's force but moves each
# ghost's pull to the owner's position, dropping ``shift (x) share`` from the virial. That
# is what ``shares + replicated`` did when it took the OWNED kind: autograd adds the
# gradient of an energy term in raw positions (``positions.sum()``, ``.mean()``, a
# centre of mass, ``(positions @ W).sum()``: an expanded replicated value) to the edges'
# shares, and the stress came out 1e-4 .. 1e-1 off with exact energy and forces. A plain
# addend (replicated tensor uniform along the rows, or a number) is a value per atom, so
# its shares are its owned rows with zero ghost rows: added so, the sum stays SHARES
# (the same value) and keeps the partials by row.
def _plain_addend_as_shares(func, args, kwargs):
    """NOTE [shares plus a replicated value]: ``shares +- plain`` with the plain addend as
    shares (its owned rows, zero ghost rows); None when the call is not of that form."""
    name = func.overloadpacket.__name__.rstrip("_")
    if name not in ("add", "sub", "rsub") or len(args) < 2:
        return None
    a, b = args[0], args[1]
    rows_at = [i for i, t in enumerate((a, b)) if rows_of(t)]
    if len(rows_at) != 1 or rows_of((a, b)[rows_at[0]]).kind != SHARES:
        return None
    shares, other_at = (a, b)[rows_at[0]], 1 - rows_at[0]
    other = (a, b)[other_at]
    if isinstance(other, bool) or not isinstance(other, (torch.Tensor, int, float)):
        return None
    if is_inplace(func) and other_at == 0:  # written into the plain tensor: the generic path
        return None
    p = shares._place
    other_local = unwrap(other)
    ndim = max(shares.dim(), other_local.dim() if isinstance(other_local, torch.Tensor) else 0)
    out_dim = p.dim + ndim - shares.dim()
    if isinstance(other_local, torch.Tensor):
        shape = torch.broadcast_shapes(shares.shape, other_local.shape)
        if other_local.dim() and not uniform_along(other_local, out_dim - (ndim - other_local.dim())):
            return None  # refused by the generic path, with its message
    else:
        shape = shares.shape
    if tuple(shape) != tuple(shares.shape) and is_inplace(func):
        return None
    dtype = torch.result_type(shares._local, other_local)
    full = torch.as_tensor(other_local, dtype=dtype, device=shares.device).expand(shape).contiguous()
    full = comm.zero_ghosts(full, out_dim, shares._ctx.plan, p.group)
    new = list(args)
    new[other_at] = ShardTensor(full, Rows(out_dim, SHARES, p.group), shares._ctx, "a plain addend as shares")
    if not isinstance(other, torch.Tensor):  # a number's overload (add.Scalar) takes no tensor there
        func = func.overloadpacket.Tensor
    return func, tuple(new)


def _same_row_test(func, tensors, rows) -> bool:
    """``sender == receiver`` (or ``!=``): whether two atom row numbers name the same row. A
    rank's rows are distinct (atom, image) pairs (halo storage: a ghost row is another
    image; sharded storage: a request-table row is a remote atom), so row equality is
    the same test as in one process; an order or arithmetic of the numbers is not."""
    return func.overloadpacket in (aten.eq, aten.ne) and len(tensors) == len(rows) == 2 \
        and all(t._place.values == "atoms" and t._place.kind == EDGES for t in rows)


class _Converted:
    __slots__ = ("local",)

    def __init__(self, local):
        self.local = local


def _plain(a):
    return a.local if isinstance(a, _Converted) else a


def _factor(x):
    """An operand of a product with shares: the shares as they are, a factor per row
    as every row's value (ghost rows included)."""
    return x._local if x._place.kind == SHARES else as_ghosted(x)


def _linear_in_shares(func, args, tensors, rows) -> bool:
    name = func.overloadpacket.__name__.rstrip("_")
    if func.overloadpacket not in LINEAR:
        return False
    if name in ("add", "sub", "rsub"):
        return len(tensors) == len(rows) == 2 and all(t._place.is_atoms() for t in rows)
    if name in ("mul", "div"):
        shares = [t for t in rows if t._place.kind == SHARES]
        return len(shares) == 1 and (name == "mul" or args[0] is shares[0])
    return True  # neg, copies


# ---- views and shape ops -----------------------------------------------------------------
def _view_place(func, args, p: Rows, in_shape, out_shape):
    """Where the rows go when ``in_shape`` is viewed as ``out_shape`` (row-major): the
    output dim whose prefix product equals the input's before the rows, holding the
    rows (merged with dims after them: ``group`` entries per row)."""
    n = in_shape[p.dim] // p.group
    if n == 0:
        in_shape, out_shape = _probe_shapes(func, args, p, in_shape, out_shape)
        n = in_shape[p.dim] // p.group
    before = math.prod(in_shape[: p.dim])
    prefix = 1
    for d, size in enumerate(out_shape):
        if prefix == before and n > 0 and size > 0 and size % n == 0:
            group = size // n
            if _groups_fit(in_shape, p, group):
                return p.moved(d, group)
        prefix *= size
        if prefix > before:
            break
    if n == 0 or 0 in out_shape:
        return None
    return refuse(func, args, {}, f"this view merges the rows (dim {p.dim} of {tuple(in_shape)}) with a dimension "
                  f"before them, or splits them ({tuple(out_shape)})",
                  "keep the rows as the outer dimension of any reshape (x.reshape(n, -1), x.flatten(1))")


_PROBE_ROWS = 1_000_003  # a prime no other dimension is a multiple of


def _probe_shapes(func, args, p: Rows, in_shape, out_shape):
    """A rank with no rows (sharded storage: an empty subdomain) sees ``(0, 3)`` viewed as
    ``(0, 3)``, whose zeros do not say where the rows went; the other ranks place them by
    their sizes, so this rank must decide alike (its reductions are collectives too): the
    shapes with a probe row count instead of 0, the one zero dim of the view holding them."""
    zeros = [d for d, size in enumerate(out_shape) if size == 0]
    others_in = math.prod(size for d, size in enumerate(in_shape) if d != p.dim) * p.group
    others_out = math.prod(size for d, size in enumerate(out_shape) if d not in zeros)
    if len(zeros) != 1 or 0 in [size for d, size in enumerate(in_shape) if d != p.dim] or others_out == 0 \
            or (_PROBE_ROWS * others_in) % others_out:
        refuse(func, args, {}, f"a view of this rank's zero rows ({tuple(in_shape)} as {tuple(out_shape)}) that "
               "does not say where the rows go", "keep the rows as the outer dimension of any reshape "
               "(x.reshape(n, -1), x.flatten(1))")
    probe_in = list(in_shape)
    probe_in[p.dim] = _PROBE_ROWS * p.group
    probe_out = list(out_shape)
    probe_out[zeros[0]] = _PROBE_ROWS * others_in // others_out
    return tuple(probe_in), tuple(probe_out)


def _sizes_of_no_rows(func, args, p: Rows, in_shape, sizes: list) -> list:
    """``x.view(x.shape[0], -1)`` of this rank's zero rows: torch cannot infer the -1 from
    zero elements ("can be any value"), the peers infer it from theirs. The rows kept where
    they are (the one zero size at the rows' dim, the dims before it unchanged), the -1 is
    what it is on every rank: the entries of a row over the known sizes after the rows."""
    zeros = [d for d, size in enumerate(sizes) if size == 0]
    if p.group == 1 and zeros == [p.dim] and list(sizes[: p.dim]) == list(in_shape[: p.dim]) \
            and sizes.count(-1) == 1 and 0 not in in_shape[p.dim + 1:]:
        known = math.prod(size for d, size in enumerate(sizes) if d > p.dim and size != -1)
        per_row = math.prod(in_shape[p.dim + 1:])
        if known and per_row % known == 0:
            return [per_row // known if size == -1 else size for size in sizes]
    return refuse(func, args, {}, f"a view of this rank's zero rows ({tuple(in_shape)} as {tuple(sizes)}) whose -1 "
                  "zero elements cannot determine", "keep the rows as the outer dimension and name it "
                  "(x.view(x.shape[0], -1))")


def _groups_fit(in_shape, p: Rows, group: int) -> bool:
    if group % p.group == 0:  # merged with whole dims after the rows
        need, prod = group // p.group, 1
        for size in in_shape[p.dim + 1 :]:
            if prod == need:
                break
            prod *= size
        return prod == need
    return p.group % group == 0  # a merged row dim split back


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view(func, args, kwargs):
    x = args[0]
    if x.numel() == 0 and -1 in list(args[1]) and 0 in list(args[1]):  # torch: "-1 can be any value"
        args = (x, _sizes_of_no_rows(func, args, x._place, tuple(x.shape), list(args[1])), *args[2:])
    out = run_local(func, args, kwargs)
    place = _view_place(func, args, x._place, tuple(x.shape), tuple(out.shape)) or x._place.moved(0)
    return finish(func, args, out, place, x._ctx)


@rule(aten.expand.default)
def expand(func, args, kwargs):
    x, sizes = args[0], args[1]
    p = x._place
    lead = len(sizes) - x.dim()
    d = p.dim + lead
    if sizes[d] not in (-1, x.shape[p.dim]):
        refuse(func, args, kwargs, "it expands the row dimension")
    return finish(func, args, run_local(func, args, kwargs), p.moved(d), x._ctx)


@rule(aten.permute.default)
def permute(func, args, kwargs):
    x, dims = args[0], [d % args[0].dim() for d in args[1]]
    return finish(func, args, run_local(func, args, kwargs), x._place.moved(dims.index(x._place.dim)), x._ctx)


@rule(aten.transpose.int, aten.transpose_.default)
def transpose(func, args, kwargs):
    x = args[0]
    a, b = args[1] % max(x.dim(), 1), args[2] % max(x.dim(), 1)
    d = x._place.dim
    d = b if d == a else a if d == b else d
    return finish(func, args, run_local(func, args, kwargs), x._place.moved(d), x._ctx)


@rule(aten.t.default, aten.t_.default)
def t(func, args, kwargs):
    x = args[0]
    d = x._place.dim if x.dim() < 2 else 1 - x._place.dim
    return finish(func, args, run_local(func, args, kwargs), x._place.moved(d), x._ctx)


@rule(aten.unsqueeze.default, aten.unsqueeze_.default)
def unsqueeze(func, args, kwargs):
    x = args[0]
    at = args[1] % (x.dim() + 1)
    d = x._place.dim + (1 if at <= x._place.dim else 0)
    return finish(func, args, run_local(func, args, kwargs), x._place.moved(d), x._ctx)


@rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.squeeze_.dim)
def squeeze(func, args, kwargs):
    x = args[0]
    p = x._place
    if len(args) > 1:
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        dims = {d % x.dim() for d in dims if x.shape[d % x.dim()] == 1}
    else:
        dims = {d for d in range(x.dim()) if x.shape[d] == 1}
    if p.dim in dims and x.shape[p.dim] == 1:
        refuse(func, args, kwargs, "it squeezes away the row dimension (this rank holds one row)",
               "squeeze the dimensions you mean by number (x.squeeze(-1)), never the rows")
    d = p.dim - sum(1 for k in dims if k < p.dim)
    return finish(func, args, run_local(func, args, kwargs), p.moved(d), x._ctx)


def _diagonal_dims(args, kwargs, ndim: int) -> tuple[int, int]:
    dim1 = args[2] if len(args) > 2 else kwargs.get("dim1", 0)
    dim2 = args[3] if len(args) > 3 else kwargs.get("dim2", 1)
    return dim1 % ndim, dim2 % ndim


@rule(aten.diagonal.default)
def diagonal(func, args, kwargs):
    """The diagonal of two dims other than the rows (TensorNet's trace of a 3x3 per edge):
    row-local; both dims go, the diagonal is appended last."""
    x = args[0]
    p = x._place
    dims = _diagonal_dims(args, kwargs, x.dim())
    if p.dim in dims:
        refuse(func, args, kwargs, "it takes a diagonal across the row dimension")
    return finish(func, args, run_local(func, args, kwargs), p.moved(p.dim - sum(k < p.dim for k in dims)), x._ctx)


@rule(aten.diagonal_backward.default)
def diagonal_backward(func, args, kwargs):
    """The adjoint of `diagonal`: zeros of the input's shape, the gradient on the diagonal
    (linear: any kind stays); the rows go back to the input's row dim."""
    grad, sizes = args[0], args[1]
    ndim = len(sizes)
    dim1 = args[3] if len(args) > 3 else kwargs.get("dim1")
    dim2 = args[4] if len(args) > 4 else kwargs.get("dim2")
    kept = [k for k in range(ndim) if k not in (dim1 % ndim, dim2 % ndim)]
    p = grad._place
    if p.dim >= len(kept):
        refuse(func, args, kwargs, "the gradient of a diagonal across the row dimension")
    return finish(func, args, run_local(func, args, kwargs), p.moved(kept[p.dim]), grad._ctx)


@rule(aten.slice.Tensor)
def slice_(func, args, kwargs):
    x = args[0]
    dim = (args[1] if len(args) > 1 else 0) % x.dim()
    p = x._place
    if dim == p.dim:
        start = args[2] if len(args) > 2 else None
        end = args[3] if len(args) > 3 else None
        step = args[4] if len(args) > 4 else 1
        whole = (start in (None, 0)) and (end is None or end >= x.shape[dim]) and step == 1
        if not whole:
            refuse(func, args, kwargs, "it slices the row dimension (x[a:b]): the rows are a different set of "
                   "atoms or edges on each rank", "select rows by a mask or an index of the same rows")
    return finish(func, args, run_local(func, args, kwargs), p, x._ctx)


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
      aten.unsafe_split.Tensor)
def split(func, args, kwargs):
    x = args[0]
    default_dim = 0
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", default_dim)) if func.overloadpacket is not aten.unbind \
        else (args[1] if len(args) > 1 else 0)
    dim %= x.dim()
    p = x._place
    if dim == p.dim:
        refuse(func, args, kwargs, "it splits the row dimension: this rank's rows are not the whole system's "
               "in one process's order, so no block of them is one system's or one chunk's atoms",
               "pool per system with a scatter by the system index (h.new_zeros(n_systems, F).index_add(0, "
               "batch.batch, h), divided by torch.bincount(batch.batch) for a mean), or keep the step row-local")
    out = run_local(func, args, kwargs)
    if func.overloadpacket is aten.unbind:
        p = p.moved(p.dim - (1 if dim < p.dim else 0))
    return wrap_out(out, p, x._ctx, op_name(func.overloadpacket))


def _joined(func, args, kwargs, tensors):
    """Operands of a join (cat, stack) as local tensors of one kind: all shares stay shares
    (a join is linear), owned+ghost rows are valid owned rows, else shares are summed."""
    ndim = max(t.dim() for t in tensors)
    rows = [t for t in tensors if rows_of(t)]
    first = rows[0]._place
    row_dim = first.dim + ndim - rows[0].dim()
    for t in rows:
        p = t._place
        if (p.dim + ndim - t.dim(), p.group, p.is_atoms()) != (row_dim, first.group, first.is_atoms()):
            refuse(func, args, kwargs, "it joins tensors with different row placements",
                   "bring them to one kind first (the same rows along the same dimension)")
    kinds = {t._place.kind for t in rows}
    kind = kinds.pop() if len(kinds) == 1 else OWNED
    locals_ = []
    for t in tensors:
        if not rows_of(t):
            if not uniform_along(t, row_dim - (ndim - t.dim())) or kind == SHARES:
                refuse(func, args, kwargs, "a replicated or plain operand with its own value per row, or joined "
                       "with shares of atom rows")
            locals_.append(unwrap(t))
        elif t._place.kind == SHARES and kind != SHARES:
            locals_.append(as_owned(t))
        else:
            locals_.append(t._local)
    values = first.values if all(t._place.values == first.values for t in rows) else None
    return locals_, Rows(row_dim, kind, first.group, values)


@rule(aten.cat.default)
def cat(func, args, kwargs):
    # torch lets an empty 1-D tensor join anything; a rank with no rows may hold only those
    tensors = [t for t in args[0] if t.numel() or t.dim() > 1] or list(args[0])
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % max(t.dim() for t in tensors)
    locals_, place = _joined(func, args, kwargs, tensors)
    if dim == place.dim:
        refuse(func, args, kwargs, "it appends rows (cat along the row dimension): the result is no longer "
               "this rank's rows", "add extra rows as their own tensor")
    return finish(func, args, func(locals_, dim), place, ctx_of(args, kwargs))


@rule(aten.stack.default)
def stack(func, args, kwargs):
    tensors = list(args[0])
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % (tensors[0].dim() + 1)
    locals_, place = _joined(func, args, kwargs, tensors)
    return finish(func, args, func(locals_, dim), place.moved(place.dim + (1 if dim <= place.dim else 0)),
                  ctx_of(args, kwargs))


@rule(aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default)
def like(func, args, kwargs):
    """Same rows; every row its own value (a uniform fill is the same on ghost copies)."""
    p = args[0]._place
    kind = GHOSTED if p.is_atoms() else p.kind
    return finish(func, args, run_local(func, args, kwargs), Rows(p.dim, kind, p.group), args[0]._ctx)


@rule(aten.rand_like.default, aten.randn_like.default)
def random_like(func, args, kwargs):
    """A draw per row, as one process draws one per row (UMA's random roll angle per edge):
    edges stay edges; atom rows are right on the owned rows (a ghost draws its own number,
    so a read by ghosts copies the owner's first)."""
    p = args[0]._place
    kind = OWNED if p.is_atoms() else p.kind
    return finish(func, args, run_local(func, args, kwargs), Rows(p.dim, kind, p.group), args[0]._ctx)


@rule(aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
      aten.new_empty_strided.default)
def new_factory(func, args, kwargs):
    """A tensor of a given size from a distributed tensor: replicated (its size says nothing
    about rows); a scatter by the edge index makes it atom rows."""
    return finish(func, args, run_local(func, args, kwargs), REPLICATE, args[0]._ctx)


@rule(aten.copy_.default)
def copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, ShardTensor):
        refuse(func, args, kwargs, "it copies distributed rows into a plain tensor",
               "keep the result a distributed tensor (out-of-place ops, torch.zeros_like(x))")
    if rows_of(dst) and not rows_of(src) and not uniform_along(src, dst._place.dim):
        refuse(func, args, kwargs, "it copies per-row values of a plain tensor into distributed rows")
    place = src._place if rows_of(src) else dst._place
    if rows_of(src) and isinstance(dst._base, ShardTensor):
        place = _rows_into_base(func, args, kwargs, dst._base, dst, place)
        if place.kind != src._place.kind:  # shares written into complete rows: their sums
            args = (dst, ShardTensor(as_owned(src), place, src._ctx, src._origin), *args[2:])
    run_local(func, args, kwargs)
    dst._place = place
    return dst


def _rows_into_base(func, args, kwargs, base: ShardTensor, view: ShardTensor, place: Rows) -> None:
    """``x[:, 0] = rows`` writes rows into a view: the view's base holds them too (UMA's
    ``torch.zeros(n, L, C)`` filled at l = 0). Its row dim is the one of the view's row
    size and stride; the rest of a replicated base must be equal along it (zeros), and a
    base of atom rows keeps one kind (mixed kinds: owned rows, shares summed first).
    Returns the placement the written view takes."""
    bp = rows_of(base)
    n, stride = view.shape[place.dim], view.stride(place.dim)
    dims = [d for d in range(base.dim()) if base.shape[d] == n and base.stride(d) == stride]
    if bp is not None and bp.dim in dims:
        dims = [bp.dim]
    if len(dims) != 1 or (bp is None and not uniform_along(base, dims[0])) or (bp is not None and (
            bp.is_atoms() != place.is_atoms() or bp.group != 1)):
        refuse(func, args, kwargs, "it writes rows into part of a tensor that holds other values along them "
               "(per-row values of a plain tensor, rows of another kind, or rows along another dimension)",
               "build the whole tensor from the rows (torch.cat / torch.stack of rows), or write into "
               "torch.zeros_like of them")
    if bp is None or bp.kind == place.kind:
        base._place = Rows(dims[0], place.kind, 1)
        return place
    if bp.kind == SHARES:  # the base's shares summed into their owners, in place (the same values)
        base._local.copy_(as_owned(base))
    base._place = bp.as_kind(OWNED).plain_values()
    return place.as_kind(OWNED)


@rule(aten._local_scalar_dense.default, aten.equal.default, aten.is_same_size.default, aten.nonzero.default,
      aten.unique_dim.default, aten.sort.default, aten.argsort.default,
      aten.masked_select.default)
def host_values(func, args, kwargs):
    refuse(func, args, kwargs, "it reads this rank's rows as values or positions (an item, a sort, the "
           "positions of nonzeros): they differ between one process and the ranks",
           "reduce over the rows first (x.sum(0), x.amax(0)), keep the step row-local, or, for bookkeeping that is "
           "exact per rank by construction (pairs of one receiver's edges, a receiver's neighbour table), compute "
           "it on mlipdd.shard.local(x) and declare the result with mlipdd.shard.as_atom_rows (NOTE [declared rows])")


@rule(aten._unique2.default, aten._unique.default)
def unique(func, args, kwargs):
    """The distinct values of rows (``torch.unique(z)``): the union over ranks, replicated;
    with inverse indices or counts (positions and counts of this rank's rows) refused."""
    x = args[0]
    p = x._place
    inverse = args[2] if len(args) > 2 else kwargs.get("return_inverse", False)
    counts = args[3] if len(args) > 3 else kwargs.get("return_counts", False)
    if counts or x.dim() != 1 or p.values == "atoms":
        refuse(func, args, kwargs, "unique with counts (or of atom row numbers) describes this rank's rows",
               "count with index_add / bincount by the values, a sum over the rows")
    mine = torch.unique(valid_rows(x._local, p.as_kind(OWNED) if p.is_atoms() else p, x._ctx))
    group = x._ctx.group
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, torch.tensor([mine.numel()]), group=group)
        longest = int(max(s_ for s_ in sizes))
        padded = torch.cat([mine, mine.new_zeros(longest - mine.numel())])
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        mine = torch.unique(torch.cat([part[: int(n)] for part, n in zip(parts, sizes)]))
    # the inverse: each row's position among the distinct values of the whole system
    inv = torch.searchsorted(mine, x._local) if inverse else mine.new_empty(0)
    inv_place = Rows(p.dim, p.kind if p.kind != SHARES else OWNED) if inverse else REPLICATE
    uniq = ShardTensor(mine, REPLICATE, x._ctx, "aten::unique")
    inv = ShardTensor(inv, inv_place, x._ctx, "aten::unique")
    if func is aten._unique2.default:
        return uniq, inv, ShardTensor(mine.new_empty(0), REPLICATE, x._ctx, "aten::unique")
    return uniq, inv


# ---- sizes used as values ----------------------------------------------------------------
# NOTE [aten counts]
# ``h.sum(0) / h.shape[0]`` or ``messages / (n_edges / n_atoms)`` divide by THIS rank's row
# count: the wrapper has the local shape, and a Python number carries no origin. The
# arithmetic ops check their number arguments against this rank's counts and simple
# ratios of them, where those differ from the counts of the whole system; a match is
# refused (never a silent answer: a coincidence costs a refusal, not a wrong number). An
# integer is taken for a count only when it divides or scales a replicated value (a sum
# over the rows: ``h.sum(0) / n``), since models scale rows by integer constants (MACE's
# envelope by 35); a non-integer that is no plain fraction (k/8) is compared with every ratio
# of the sizes a model can read (atom rows and edge rows: ``n_edges / n_atoms``; the owned
# count is no tensor's size, its ratios only ever matched model constants).
# Sizes that never meet such an op (``range(n)``) are the validator's to catch.
_ARITHMETIC = {aten.div, aten.div_, aten.mul, aten.mul_, aten.true_divide}


def refuse_local_counts(func, args, kwargs, ctx):
    numbers = [a for a in args[1:] if isinstance(a, (int, float)) and not isinstance(a, bool)]
    numbers += [float(unwrap(a)) for a in args[1:] if isinstance(a, torch.Tensor) and rows_of(a) is None
                and a.dim() == 0 and a.device.type == "cpu" and a.dtype != torch.bool]
    if not numbers:
        return
    # constants that are plain fractions (0.5, 0.25, 1.5) are the model's, not a count's ratio
    numbers = [x for x in numbers if float(x).is_integer() or not float(x * 8).is_integer()]
    if not numbers:
        return
    suspicious = ctx.local_counts()
    replicated_operand = rows_of(args[0]) is None
    for number in numbers:
        for value, what in suspicious:
            if float(number).is_integer() and not (what.startswith("the number") and replicated_operand):
                continue  # an integer: only a count, only dividing a reduced (replicated) value
            if number != 0 and (math.isclose(number, value, rel_tol=1e-12) or math.isclose(number * value, 1.0, rel_tol=1e-12)):
                refuse(func, args, kwargs, f"it multiplies or divides by {number!r}, which is {what} on this rank "
                       "(a size of the local rows used as a value: one process has another count)",
                       "count with a sum over the rows (torch.ones_like(x).sum(0), a per-system index_add), "
                       "never with x.shape")


@rule(aten.slice_backward.default)
def slice_backward(func, args, kwargs):
    """The adjoint of a slice of other dims, or of a whole slice of the rows: zeros around the
    rows' values (linear: any kind stays). The select rules, its adjoint's too, are in `mlipdd.shard.aten.global_rows`."""
    grad, sizes, dim = args[0], args[1], args[2] % len(args[1])
    p = grad._place
    start, end, step = args[3], args[4], args[5]  # all required in slice_backward's schema
    whole = start in (None, 0) and (end is None or end >= sizes[dim]) and step == 1
    if dim == p.dim and not whole:  # a whole slice of the rows (the only one `slice_` lets through) is the identity
        refuse(func, args, kwargs, "the gradient of a slice of the rows")
    return finish(func, args, run_local(func, args, kwargs), p.plain_values(), grad._ctx)
