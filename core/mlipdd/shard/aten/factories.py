"""Factory tensors of a distributed forward are ShardTensors too (a dispatch mode).

# NOTE [aten factories]
``torch.zeros(n, F)`` has no tensor argument, so no subclass sees it; a model that then
scatters into it IN PLACE (``out.scatter_add_(0, receiver, messages)``: MACE's
scatter_sum, torch_scatter's ``out=``) would leave atom-row shares in a plain tensor,
which no later op can tell from a replicated one (its ``.sum()`` would not even reach
the dispatch). While the model runs, `factory_rows` makes every factory's result a
replicated ShardTensor; an in-place scatter by the edge index then turns it into atom
rows in place (NOTE [aten halo rules]), and every later op on it reaches the rules.
A new tensor made from a plain one (``self.readout.new_zeros(n)``, ``torch.zeros_like(w)``
of a parameter) is a factory too: the same accumulator, spelt from a tensor. mlipdd's own
code in the model's scope keeps plain factories (NOTE [internal factories]).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlipdd.shard.aten.placement import REPLICATE
from mlipdd.shard.aten.tensor import ShardTensor
from mlipdd.shard.internal import is_internal

aten = torch.ops.aten
FACTORIES = {aten.zeros, aten.ones, aten.full, aten.empty, aten.empty_strided, aten.arange, aten.scalar_tensor,
             aten.eye, aten.linspace, aten.lift_fresh, aten.lift_fresh_copy, aten.randn, aten.rand,
             aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full, aten.new_empty_strided,
             aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.rand_like, aten.randn_like}
# (new_* and *_like of a ShardTensor come back from its rules as ShardTensors: left as they are)


class _FactoryRows(TorchDispatchMode):
    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func.overloadpacket in FACTORIES and isinstance(out, torch.Tensor) and not isinstance(out, ShardTensor)
                and not is_internal()):
            return ShardTensor(out, REPLICATE, self.ctx, f"torch.{func.overloadpacket.__name__}")
        return out


@contextlib.contextmanager
def factory_rows(ctx):
    """NOTE [aten factories]; ``ctx``: the forward's HaloContext."""
    with _FactoryRows(ctx):
        yield
