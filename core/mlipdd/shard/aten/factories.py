"""Factory tensors of a distributed forward are ShardTensors too (a dispatch mode).

# NOTE [aten factories]
``torch.zeros(n, F)`` has no tensor argument, so no subclass sees it; a model that then
scatters into it IN PLACE (``out.scatter_add_(0, receiver, messages)``: MACE's
scatter_sum, torch_scatter's ``out=``) would leave atom-row shares in a plain tensor,
which no later op can tell from a replicated one (its ``.sum()`` would not even reach
the dispatch). While the model runs, `factory_rows` makes every factory's result a
replicated ShardTensor; an in-place scatter by the edge index then turns it into atom
rows in place (NOTE [aten halo rules]), and every later op on it reaches the rules.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlipdd.shard.aten.placement import REPLICATE
from mlipdd.shard.aten.tensor import ShardTensor

aten = torch.ops.aten
FACTORIES = {aten.zeros, aten.ones, aten.full, aten.empty, aten.empty_strided, aten.arange, aten.scalar_tensor,
             aten.eye, aten.linspace, aten.lift_fresh, aten.lift_fresh_copy, aten.randn, aten.rand}


class _FactoryRows(TorchDispatchMode):
    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in FACTORIES and isinstance(out, torch.Tensor) and not isinstance(out, ShardTensor):
            return ShardTensor(out, REPLICATE, self.ctx, f"torch.{func.overloadpacket.__name__}")
        return out


@contextlib.contextmanager
def factory_rows(ctx):
    """NOTE [aten factories]; ``ctx``: the forward's HaloContext."""
    with _FactoryRows(ctx):
        yield
