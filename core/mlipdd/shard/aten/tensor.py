"""The aten-level `ShardTensor`: a wrapper subclass whose ``__torch_dispatch__`` does the
cross-rank work, one rule per aten op.

The wrapper has the LOCAL shape (this rank's rows: a model's ``torch.zeros(n, F)`` is
this rank's accumulator) and holds the local tensor in ``_local``; ``_place`` is its
placement (NOTE [aten placements]), ``_ctx`` the forward's `HaloContext` and
``_origin`` the op that made it, for error messages.

# NOTE [aten gradients]
Autograd runs ABOVE ``__torch_dispatch__``: it records each aten op on ShardTensors and
differentiates it with torch's own formula, whose aten ops come back through the same
rules. Every rule keeps the GLOBAL value right (the value one process would compute
for the whole system), so the formulas compute global gradients: the backward of an
``index_select`` of GHOSTED rows is an ``index_add`` into atom rows, which gives
SHARES, exactly what the adjoint of a ghost copy is. No per-op gradient code exists.
A rule's collectives are invisible to autograd, which is right because they change
the representation of a value, never the value. `from_local` / `to_local` are the
two autograd boundaries with plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlipdd.shard.aten import comm
from mlipdd.shard.aten.placement import GHOSTED, OWNED, REPLICATE, SHARES, Replicate, Rows

__all__ = ["AtenRefusal", "HaloContext", "ShardTensor", "from_local", "to_local", "unwrap"]


class AtenRefusal(RuntimeError):
    """An aten op on distributed rows without an exact rule (raised on every rank)."""


@dataclass(eq=False)
class HaloContext:
    """What one forward's rows are: the halo plan, this rank's edge count, the group.

    Equal when it holds the same plan object (reused until the next rebuild) and edge
    count: torch.compile guards on it (the ShardTensor's flatten metadata), so a compiled
    forward is reused until a rebuild."""

    plan: object  # mlipdd.shard.exchange.ExchangePlan (sharded storage: comm.OwnedRowsOnly)
    n_edges: int
    group: object = None
    reads: object = None  # sharded storage: the request table's ExchangePlan (NOTE [aten sharded storage])
    atom_ids: object = None  # the owned rows' ids, one process's row order (NOTE [a row by its global number])
    local_rows_taken: bool = False  # the model took mlipdd.shard.local() of rows (NOTE [rank-local values])
    _global: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.key = (id(self.plan), id(self.reads), self.n_edges, id(self.group))  # survives the guards' copies

    def __eq__(self, other) -> bool:
        return isinstance(other, HaloContext) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def n_owned(self) -> int:
        return self.plan.n_owned

    @property
    def n_padded(self) -> int:
        return self.plan.n_padded

    def local_counts(self) -> list[tuple[float, str]]:
        """This rank's row counts and their ratios that differ from the whole system's
        (NOTE [aten counts]); counts of 8 rows or fewer are left out (small constants)."""
        if "counts" not in self._global:
            atoms, edges = self.global_count("atoms"), self.global_count("edges")
            local = {"the atom rows (owned + ghost)": (self.n_padded, atoms), "the owned atoms": (self.n_owned, atoms),
                     "the edges": (self.n_edges, edges)}
            out = []
            for name, (n, total) in local.items():
                if n > 8 and n != total:
                    out.append((float(n), f"the number of {name}"))
            # ratios only of the counts a model reads as sizes (x.shape[0] of atom rows, of edge
            # rows): the owned count is no tensor's size under halo storage (and equals the atom
            # rows under sharded storage), so its ratios were coincidences only (DSF's alpha 0.2
            # at a rank of 24 owned atoms in 120 rows)
            sizes = {k: v for k, v in local.items() if k != "the owned atoms"}
            for (a, (na, ta)), (b, (nb, tb)) in [(x, y) for x in sizes.items() for y in sizes.items() if x != y]:
                if na and nb and abs(na / nb - ta / tb) > 1e-12 * abs(ta / tb):
                    out.append((na / nb, f"a ratio of {a} and {b}"))
            self._global["counts"] = out
        return self._global["counts"]

    def global_count(self, what: str) -> int:
        """Atoms or edges over all ranks (one all_reduce the first time; every rank asks
        at the same op, since every rank runs the same ops)."""
        if what not in self._global:
            local = self.n_owned if what == "atoms" else self.n_edges
            self._global[what] = comm.global_count(local, self.group)
        return self._global[what]


class ShardTensor(torch.Tensor):
    _local: torch.Tensor
    _place: object
    _ctx: HaloContext
    _origin: str

    @staticmethod
    def __new__(cls, local: torch.Tensor, place, ctx: HaloContext, origin: str = "", requires_grad: bool = False):
        out = torch.Tensor._make_wrapper_subclass(
            cls, local.size(), strides=local.stride(), storage_offset=local.storage_offset(),
            dtype=local.dtype, device=local.device, layout=local.layout, requires_grad=requires_grad,
        )
        out._local, out._place, out._ctx, out._origin = local, place, ctx, origin
        return out

    def __repr__(self) -> str:
        return f"ShardTensor({self._place}, origin={self._origin!r}, local={self._local!r})"

    @property
    def placement(self):
        return self._place

    # NOTE [host reads of a ShardTensor]
    # ``.tolist()`` and ``.numpy()`` read the data on the host without an aten op, so no rule
    # sees them, and torch refuses them for any tensor subclass with a bare RuntimeError.
    # A replicated value is the same on every rank: its list is exact. Rows are this rank's
    # rows (a list of them differs between ranks): refused by name, on every rank (each rank
    # holds the same placement at the same line of the model).
    def tolist(self):
        return self._host_read("tolist").tolist()

    def numpy(self, *, force: bool = False):
        return self._host_read("numpy").numpy(force=force)

    def _host_read(self, what: str) -> torch.Tensor:
        if isinstance(self._place, Rows):
            raise AtenRefusal(
                f"mlipdd aten dispatch refuses `Tensor.{what}` on {self._place} {tuple(self.shape)} from "
                f"`{self._origin}`: a host copy of this rank's rows (each rank holds other atoms or edges). "
                "Fix: reduce over the rows first (a sum, torch.unique or torch.bincount by the values gives "
                "the whole system's value on every rank), or keep the step in tensor ops")
        return self._local.detach()

    # torch.compile: the local tensor is the inner tensor; placement and context are static
    # metadata (the origin, for messages only, is left out: it would split guards)
    def __tensor_flatten__(self):
        return ["_local"], (self._place, self._ctx)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        place, ctx = meta
        return ShardTensor(inner["_local"], place, ctx, "compiled")

    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=None):
        """A gradient in the placement the compiled backward was traced for: the same
        value in another representation (shares, owned rows, ghost copies)."""
        place, ctx = expected_metadata
        if place == self._place:
            return self
        if isinstance(place, Rows) and isinstance(self._place, Rows) and place.moved(self._place.dim) == self._place.as_kind(place.kind).moved(self._place.dim):
            from mlipdd.shard.aten.rules import as_ghosted, as_owned, as_shares

            convert = {SHARES: as_shares, OWNED: as_owned}.get(place.kind, as_ghosted)
            return ShardTensor(convert(self), place, ctx, self._origin)
        return None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from mlipdd.shard.aten.rules import dispatch

        # a lazy conj / neg bit on the local tensor is lost to the ops below (PME's
        # fftn(mesh) * fftn(grad).conj() came out unconjugated): materialize it
        func = _MATERIALIZED.get(func, func)
        return dispatch(func, args, kwargs or {})


_MATERIALIZED = {torch.ops.aten._conj.default: torch.ops.aten.conj_physical.default,
                 torch.ops.aten._neg_view.default: torch.ops.aten.neg.default}


def unwrap(x):
    return x._local if isinstance(x, ShardTensor) else x


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, place, halo, origin):
        ctx.place, ctx.halo = place, halo
        return ShardTensor(local.detach(), place, halo, origin)

    @staticmethod
    def backward(ctx, grad):
        return _shares_local(grad, ctx.place, ctx.halo), None, None, None


def _shares_local(grad, place, halo: HaloContext) -> torch.Tensor:
    """A gradient by rows of ``place`` as the plain tensor the plain graph below expects:
    each ghost row holding its share (the adjoint of the exchange that made the rows)."""
    if not isinstance(grad, ShardTensor):
        return grad
    gp, local = grad._place, grad._local
    if isinstance(place, Rows) and place.is_atoms():
        if isinstance(gp, Replicate):  # uniform over the rows (an expanded seed): owned rows only
            return comm.zero_ghosts(local.contiguous(), place.dim, halo.plan, place.group)
        if gp.kind == SHARES:  # the ghost rows of OWNED rows count for nothing: shares go home
            return comm.accumulate(local, gp.dim, halo.plan, gp.group) if place.kind == OWNED else local
        return comm.zero_ghosts(local, gp.dim, halo.plan, gp.group)
    return local


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.place, ctx.halo, ctx.origin = x._place, x._ctx, x._origin
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx, grad):
        # NOTE [gradients of local]: a ghost row of local(x) is a copy of its owner's row, so
        # the gradient reaching it is a share of the owner's: GHOSTED rows come back as SHARES
        # (summed into their owners), or the ghosts' part of every force would be dropped.
        place = ctx.place
        if isinstance(place, Rows):
            place = (place.as_kind(SHARES) if place.kind == GHOSTED else place).plain_values()
        return ShardTensor(unwrap(grad), place, ctx.halo, ctx.origin)


def from_local(local: torch.Tensor, place, halo: HaloContext, origin: str) -> ShardTensor:
    """Wrap this rank's rows (differentiable: gradients come back as shares)."""
    if local.requires_grad:
        return _FromLocal.apply(local, place, halo, origin)
    return ShardTensor(local, place, halo, origin)


def to_local(x, own_values: bool = False) -> torch.Tensor:
    """The plain local tensor behind ``x`` (differentiable); ``x`` itself if plain.

    A replicated ``x`` with a gradient is refused unless ``own_values`` says it holds this
    rank's own values (a plain computation's accumulator: ``torch.zeros(n)`` there is a
    factory, labelled replicated; `declared_atom_rows`). For a truly replicated value (the
    strained cell) each rank's plain gradient is its own part of the whole, and a gradient
    that came back through the rules (its plain backward makes factories too) is the whole
    one: the two cannot be told apart here, and adding them up would be wrong one way or
    the other (the stress 50 % off, silently)."""
    if not isinstance(x, ShardTensor):
        return x
    if x.requires_grad:
        if isinstance(x._place, Replicate) and not own_values:
            raise AtenRefusal(
                f"mlipdd.shard.local() of a replicated tensor that carries a gradient (from `{x._origin}`): each "
                "rank's gradient of its copy cannot be told from the whole one; Fix: compute with it on the "
                "distributed tensors and take local() of the result (e.g. local(neighbors.shifts(cell, "
                "batch.batch)) for image shifts), or local(x.detach()) where no gradient is needed")
        return _ToLocal.apply(x)
    return x._local


def owned_rows(x) -> torch.Tensor:
    """``x``'s owned atom rows as a plain tensor (shares summed into their owners)."""
    place = x._place
    local = x._local
    if isinstance(place, Rows) and place.kind == SHARES:
        local = comm.accumulate(local, place.dim, x._ctx.plan, place.group)
    return local.narrow(place.dim, 0, x._ctx.n_owned)


# NOTE [declared rows]
# A model may compute a step on plain local tensors (``mlipdd.shard.local``: this rank's
# rows, differentiable) when the step is exact per rank by construction, which no per-op
# rule can see: D3's three-body triples are pairs of edges of one receiver, and every edge
# of a receiver lives on its owner's rank (halo and sharded storage); aimnet's dense
# neighbour table lists each receiver's edges in its row. ``as_atom_rows`` declares the
# result as atom rows of the forward: ``ghosts_current=False`` makes them OWNED (ghost rows
# mean nothing: a later read by the edge index copies the owners onto them first, NOTE
# [aten halo rules]), ``index=True`` says the values are atom row numbers (a table read
# rows by). From there every op goes through the rules again. The declaration is the
# model's (a wrong one is a wrong answer), as with `declare_row_local`.
def declared_atom_rows(t: torch.Tensor, like: ShardTensor, ghosts_current: bool = True,
                       index: bool = False) -> ShardTensor:
    """NOTE [declared rows]: ``t`` (this rank's rows of ``like``, plain or replicated) as atom rows."""
    plain = to_local(t, own_values=True) if isinstance(t, ShardTensor) else t
    if isinstance(t, ShardTensor) and isinstance(t._place, Rows):
        raise AtenRefusal(f"as_atom_rows of a tensor that already holds rows ({t._place}, from `{t._origin}`); "
                          "Fix: declare the plain result of mlipdd.shard.local(...) computations only")
    reads = like._ctx.reads
    if reads is not None and plain.dim() and plain.shape[0] == reads.n_padded != like.shape[0]:
        plain = plain.narrow(0, 0, reads.n_owned)  # NOTE [local rows under sharded storage]: the owned rows
    if plain.shape[:1] != like.shape[:1]:
        raise AtenRefusal(f"as_atom_rows of a tensor shaped {tuple(plain.shape)} for {like.shape[0]} atom rows; "
                          "Fix: one row per atom row of the forward (positions.shape[0])")
    place = Rows(0, GHOSTED if ghosts_current else OWNED, values="atoms" if index else None)
    return from_local(plain, place, like._ctx, "as_atom_rows")


def replicated(local: torch.Tensor, halo: HaloContext, origin: str) -> ShardTensor:
    return ShardTensor(local, REPLICATE, halo, origin)

