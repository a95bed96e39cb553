"""Fault injection for tests of failing together: a model that fails inside its backward.

`FailsInBackward` is the Lennard-Jones model whose force backward raises on one rank at
one call, the way an out-of-memory error does in a large model: the other ranks are then
already inside the backward's collectives (the halo exchange's adjoint), waiting for a
rank that will never arrive. ``kind="oom"`` asks the allocator for far more memory than
any machine has (a real ``torch.OutOfMemoryError`` on CUDA, the CPU allocator's error on
the CPU); ``kind="raise"`` raises a plain RuntimeError.
"""

from __future__ import annotations

import torch

from mlipdd.models.lj import LennardJones

_HUGE_BYTES = 1 << 50  # 1 PiB: no allocator grants it


def fault_message(rank: int, call: int) -> str:
    return f"injected failure in the backward on rank {rank} at force call {call}"


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind: str, message: str):
        ctx.kind, ctx.message = kind, message
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.kind == "oom":
            torch.empty(_HUGE_BYTES, dtype=torch.uint8, device=grad.device)
        raise RuntimeError(ctx.message)


class FailsInBackward(LennardJones):
    """LJ argon; on ``fail_rank`` the ``fail_call``-th force evaluation fails in the backward."""

    def __init__(self, fail_rank: int, fail_call: int, kind: str = "raise", cutoff: float = 5.5):
        super().__init__(epsilon=0.0104, sigma=3.4, cutoff=cutoff)
        self.fail_rank, self.fail_call, self.kind = int(fail_rank), int(fail_call), kind
        self.calls = 0

    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        self.calls += 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == self.fail_rank and self.calls == self.fail_call:
            energies = _RaiseInBackward.apply(energies, self.kind, fault_message(rank, self.calls))
        return energies
