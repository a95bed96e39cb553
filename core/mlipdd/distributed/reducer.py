"""`DistributedReducer`: the dynamics' one door for global sums, over a process group.

The integrators route every sum over atoms through ``dynamics.reduce`` (see NOTE [one
door for global sums] in `mlipdd.dynamics.reduce`). `DomainParallel` installs this
subclass so that those sums become all-reduces over the decomposition's group; the
integrators never call ``torch.distributed`` themselves. Every rank runs the same
integrator code, so every rank issues the same reductions in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mlipdd.comm import OnGroup, any_rank
from mlipdd.dynamics.reduce import GlobalReducer


class DistributedReducer(OnGroup, GlobalReducer):
    """All-reduce SUM / MAX / logical OR over ``group`` (the default group when None)."""

    is_distributed = True

    def __init__(self, group=None):
        self.group = group



    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def sum(self, local: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(local, dist.ReduceOp.SUM)

    def max(self, local: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(local, dist.ReduceOp.MAX)

    def any(self, flag: bool) -> bool:
        return any_rank(bool(flag), self.group)

    def _all_reduce(self, local: torch.Tensor, op) -> torch.Tensor:
        if self.world_size == 1:
            return local
        # a copy: the caller's tensor may be a view of batch data it still uses
        out = local.detach().clone().contiguous()
        dist.all_reduce(out, op=op, group=self.group)
        return out
