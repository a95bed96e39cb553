"""Cross-rank row exchanges over ``all_to_all_single``, as autograd functions.

A `ExchangePlan` says which owned rows each peer mirrors: this rank sends rows
``send_index`` (grouped by destination rank, ``send_counts`` rows each) and receives
``recv_counts`` rows from each source rank; received rows become the ghost rows of
the padded ``[owned | ghost]`` layout, in source-rank order.

Two exchanges, each the other's adjoint:

* forward (`halo_fill`, `pad`): owners write their rows into the mirrors;
* reverse (`halo_accumulate`): mirrors send partial sums back, owners add them up.

# NOTE [collective order]
Every exchange is a collective, so every rank must call them in the same order;
under autograd the backward pass issues the adjoint collectives, which holds as long
as all ranks build the same graph (the model code is identical on every rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlipdd.comm import group_size
from mlipdd.shard.internal import internal


@dataclass(frozen=True)
class ExchangePlan:
    send_index: torch.Tensor  # (n_send,) owned row indices, grouped by destination rank
    send_counts: tuple[int, ...]  # rows sent to each rank
    recv_counts: tuple[int, ...]  # ghost rows received from each rank
    n_owned: int
    group: object = None

    @property
    def n_ghost(self) -> int:
        return sum(self.recv_counts)

    @property
    def n_padded(self) -> int:
        return self.n_owned + self.n_ghost

    @property
    def world_size(self) -> int:
        return len(self.send_counts)


# Bytes this process sent to other ranks through `all_to_all_rows` (rows to itself are
# not counted); benchmarks read and reset it to report the traffic of a step. Sizes are
# known on the host, so counting costs no device synchronisation.
SENT_BYTES = {"total": 0}


@internal  # NOTE [internal factories]: plain c10d buffers
def all_to_all_rows(rows: torch.Tensor, send_counts, recv_counts, group=None) -> torch.Tensor:
    """Send ``rows`` (grouped by destination) and return the rows received (grouped by source)."""
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    if len(send_counts) == 1:
        return out.copy_(rows)
    me = dist.get_rank(group)
    row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
    SENT_BYTES["total"] += (sum(send_counts) - send_counts[me]) * row_bytes
    dist.all_to_all_single(
        out, rows.contiguous(), list(recv_counts), list(send_counts), group=group
    )
    return out


@internal
def _send_forward(owned: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
    return all_to_all_rows(owned.index_select(0, plan.send_index), plan.send_counts, plan.recv_counts, plan.group)


@internal
def _send_reverse(ghost: torch.Tensor, plan: ExchangePlan, like: torch.Tensor) -> torch.Tensor:
    """Ghost partials back to their owners, summed into a tensor shaped like ``like`` (owned rows)."""
    back = all_to_all_rows(ghost, plan.recv_counts, plan.send_counts, plan.group)
    if plan.send_index.numel() == 0:
        # nothing comes back to this rank (always so at one rank). CUDA's index_add_ fails
        # ("invalid argument") on a tensor past 2^31 elements even with no index: medium MACE's
        # symmetric contraction at 27k atoms under the aten rules at one rank (2.65e9 elements, H200)
        return torch.zeros_like(like)
    return torch.zeros_like(like).index_add_(0, plan.send_index, back)


class _Pad(torch.autograd.Function):
    """owned (n_owned, ...) -> padded (n_padded, ...); ghost rows = owner rows (+ shift)."""

    @staticmethod
    @internal
    def forward(ctx, owned, plan, ghost_shift):
        ctx.plan = plan
        ghost = _send_forward(owned, plan)
        if ghost_shift is not None:
            ghost = ghost + ghost_shift
        return torch.cat([owned, ghost])

    @staticmethod
    @internal
    def backward(ctx, grad):
        plan = ctx.plan
        owned_grad = grad[: plan.n_owned]
        return owned_grad + _send_reverse(grad[plan.n_owned :], plan, owned_grad), None, None


class _Fill(torch.autograd.Function):
    """padded -> padded with ghost rows overwritten by their owners' rows."""

    @staticmethod
    @internal
    def forward(ctx, padded, plan):
        ctx.plan = plan
        owned = padded[: plan.n_owned]
        return torch.cat([owned, _send_forward(owned, plan)])

    @staticmethod
    @internal
    def backward(ctx, grad):
        plan = ctx.plan
        owned_grad = grad[: plan.n_owned]
        owned_grad = owned_grad + _send_reverse(grad[plan.n_owned :], plan, owned_grad)
        return torch.cat([owned_grad, torch.zeros_like(grad[plan.n_owned :])]), None


class _Accumulate(torch.autograd.Function):
    """padded -> padded with ghost partials added into their owners; ghost rows zeroed."""

    @staticmethod
    @internal
    def forward(ctx, padded, plan):
        ctx.plan = plan
        owned = padded[: plan.n_owned]
        owned = owned + _send_reverse(padded[plan.n_owned :], plan, owned)
        return torch.cat([owned, torch.zeros_like(padded[plan.n_owned :])])

    @staticmethod
    @internal
    def backward(ctx, grad):
        plan = ctx.plan
        owned_grad = grad[: plan.n_owned]
        return torch.cat([owned_grad, _send_forward(owned_grad, plan)]), None


class _AllReduceSum(torch.autograd.Function):
    """Sum of per-rank partials, replicated on every rank.

    # NOTE [replicated backward]
    Every rank seeds the backward of the replicated result with the same gradient
    (e.g. 1 for an energy), and each rank's partial enters the total once, so the
    adjoint is the identity, not another all_reduce.
    """

    @staticmethod
    @internal
    def forward(ctx, partial, group):
        total = partial.clone()
        if group_size(group) > 1:
            dist.all_reduce(total, group=group)
        return total

    @staticmethod
    @internal
    def backward(ctx, grad):
        return grad, None


def pad(owned: torch.Tensor, plan: ExchangePlan, ghost_shift: torch.Tensor | None = None) -> torch.Tensor:
    return _Pad.apply(owned, plan, ghost_shift)


def halo_fill(padded: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
    return _Fill.apply(padded, plan)


def halo_accumulate(padded: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
    return _Accumulate.apply(padded, plan)


def halo_correct(padded: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
    """Reverse then forward: owners gather every partial, mirrors get the final value."""
    return halo_fill(halo_accumulate(padded, plan), plan)


def all_reduce_sum(partial: torch.Tensor, group=None) -> torch.Tensor:
    return _AllReduceSum.apply(partial, group)
