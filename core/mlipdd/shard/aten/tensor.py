"""The aten-level `ShardTensor`: a wrapper subclass whose ``__torch_dispatch__`` does the
cross-rank work, one rule per aten op (``MLIPDD_DISPATCH=aten`` / ``DomainConfig(dispatch="aten")``).

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
from torch.utils._pytree import tree_map

from mlipdd.shard.aten import comm
from mlipdd.shard.aten.placement import OWNED, REPLICATE, SHARES, Replicate, Rows

__all__ = ["AtenRefusal", "HaloContext", "ShardTensor", "from_local", "to_local", "unwrap"]


class AtenRefusal(RuntimeError):
    """An aten op on distributed rows without an exact rule (raised on every rank)."""


@dataclass
class HaloContext:
    """What one forward's rows are: the halo plan, this rank's edge count, the group."""

    plan: object  # mlipdd.shard.exchange.ExchangePlan
    n_edges: int
    group: object = None
    _global: dict = field(default_factory=dict)

    @property
    def n_owned(self) -> int:
        return self.plan.n_owned

    @property
    def n_padded(self) -> int:
        return self.plan.n_padded

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

    def __repr__(self) -> str:  # noqa: D105 - the local rows, as torch prints them
        return f"ShardTensor({self._place}, origin={self._origin!r}, local={self._local!r})"

    @property
    def placement(self):
        return self._place

    # torch.compile: the local tensor is the inner tensor, the rest is static metadata
    def __tensor_flatten__(self):
        return ["_local"], (self._place, self._ctx, self._origin)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        place, ctx, origin = meta
        return ShardTensor(inner["_local"], place, ctx, origin)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from mlipdd.shard.aten.rules import dispatch

        return dispatch(func, args, kwargs or {})


def unwrap(x):
    return x._local if isinstance(x, ShardTensor) else x


def unwrap_all(tree):
    return tree_map(unwrap, tree)


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
            return comm.zero_ghosts(local.contiguous(), place.dim, halo.plan)
        if gp.kind == SHARES:
            return local
        return comm.zero_ghosts(local, gp.dim, halo.plan)
    return local


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.place, ctx.halo, ctx.origin = x._place, x._ctx, x._origin
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx, grad):
        return ShardTensor(grad, ctx.place, ctx.halo, ctx.origin)


def from_local(local: torch.Tensor, place, halo: HaloContext, origin: str) -> ShardTensor:
    """Wrap this rank's rows (differentiable: gradients come back as shares)."""
    if local.requires_grad:
        return _FromLocal.apply(local, place, halo, origin)
    return ShardTensor(local, place, halo, origin)


def to_local(x) -> torch.Tensor:
    """The plain local tensor behind ``x`` (differentiable); ``x`` itself if plain."""
    if not isinstance(x, ShardTensor):
        return x
    if x.requires_grad:
        return _ToLocal.apply(x)
    return x._local


def owned_rows(x) -> torch.Tensor:
    """``x``'s owned atom rows as a plain tensor (shares summed into their owners)."""
    place = x._place
    local = x._local
    if isinstance(place, Rows) and place.kind == SHARES:
        local = comm.accumulate(local, place.dim, x._ctx.plan)
    return local.narrow(place.dim, 0, x._ctx.n_owned)


def replicated(local: torch.Tensor, halo: HaloContext, origin: str) -> ShardTensor:
    return ShardTensor(local, REPLICATE, halo, origin)


KINDS_BY_EXCHANGE = {OWNED: "accumulate", SHARES: "zero ghosts"}
