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


# NOTE [rank-local values]
# ``mlipdd.shard.local(x)`` of rows hands the model plain tensors: this rank's rows, whose
# sums and other reductions are this rank's part of the whole, not the whole. No rule sees
# plain ops, and a plain value (or a factory filled with one: ``torch.zeros(n).index_add(0,
# receiver, w)`` is a replicated ShardTensor, NOTE [aten factories]) that meets distributed
# rows is taken for a replicated one: ``e * (1 + s)`` with ``s = local(...).sum()`` was 15 %
# off at 2 ranks, silently. So, once a forward has taken local() of rows, the factory mode
# (which sees every op, plain ones too) marks what local() hands out and every op's result
# that has a marked operand as rank-local. A marked operand that meets distributed rows
# without their row dimension (a reduced value: absent there, or of size 1 where the rows
# are more) is refused by name, on every rank; so is a marked output of the model (its
# energy summed over this rank's rows). What clears the mark: `as_atom_rows` (the model
# declares its per-atom result: its rows, not a sum of them), a collective (an all_reduce
# of this rank's parts is the whole; `mlipdd.shard.aten.comm.all_reduce`, c10d's ops) and
# any op with distributed rows (its result is the rules': rows, or a sum over them). A marked operand WITH the row dimension is a per-row value of this rank's rows,
# left to the rules (a plain per-row operand is refused there unless uniform). A row count
# read as a number (``torch.arange(local(x).shape[0])``) carries no mark: NOTE [aten counts].
MARK = "_mlipdd_rank_local"


def mark_rank_local(t) -> None:
    if isinstance(t, torch.Tensor):
        setattr(t, MARK, True)


def is_rank_local(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, MARK, False)


def clear_rank_local(t) -> None:
    if isinstance(t, torch.Tensor) and getattr(t, MARK, False):
        setattr(t, MARK, False)


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _outputs(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _outputs(o)


def refuse_reduced_local(func, args, kwargs) -> None:
    """NOTE [rank-local values]: a marked operand without the rows' dimension meeting rows."""
    from mlipdd.shard.aten.placement import Rows
    from mlipdd.shard.aten.rules import refuse

    tensors = list(_tensors(args, kwargs))
    rows = [t for t in tensors if isinstance(t, ShardTensor) and isinstance(t._place, Rows)]
    if not rows:
        return
    ref = max(rows, key=lambda t: t.dim())
    n_rows = ref.shape[ref._place.dim]
    for t in tensors:
        if not is_rank_local(t) or (isinstance(t, ShardTensor) and isinstance(t._place, Rows)):
            continue
        along = ref._place.dim + t.dim() - ref.dim()
        if along < 0 or (t.shape[along] == 1 and n_rows != 1):
            refuse(func, args, kwargs, "an operand is a value computed on mlipdd.shard.local() rows (this rank's "
                   "rows) and reduced over them (a sum, a mean, a norm): it is this rank's part of the whole, "
                   "not the whole system's value, and it meets distributed rows as if it were replicated",
                   "compute the reduction on the distributed tensors (positions, features, the edge index: the "
                   "rules sum over every rank), or declare the per-atom result with mlipdd.shard.as_atom_rows "
                   "before reducing it, or all_reduce this rank's part (mlipdd.shard.all_reduce_sum)")


def refuse_local_output(name: str, value) -> None:
    """NOTE [rank-local values]: a model output marked rank-local."""
    if is_rank_local(value):
        from mlipdd.shard.aten.tensor import AtenRefusal

        raise AtenRefusal(
            f"the model's output {name!r} is a value computed on mlipdd.shard.local() rows (this rank's rows): "
            "each rank holds its own part, not the whole system's value. Fix: declare per-atom results with "
            "mlipdd.shard.as_atom_rows(values, positions) and let the sums run on them (the base class sums "
            "atomic_energies per system), or all_reduce this rank's part (mlipdd.shard.all_reduce_sum)")


class _FactoryRows(TorchDispatchMode):
    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        marked = self.ctx.local_rows_taken and any(is_rank_local(t) for t in _tensors(args, kwargs))
        if marked and func.namespace in _COLLECTIVES:  # NOTE [rank-local values]: a collective's result
            out = func(*args, **kwargs)
            for t in (*_tensors(args, kwargs), *_outputs(out)):
                clear_rank_local(t)
            return out
        if marked and not is_internal():
            refuse_reduced_local(func, args, kwargs)
        out = func(*args, **kwargs)
        if (func.overloadpacket in FACTORIES and isinstance(out, torch.Tensor) and not isinstance(out, ShardTensor)
                and not is_internal()):
            out = ShardTensor(out, REPLICATE, self.ctx, f"torch.{func.overloadpacket.__name__}")
        if marked and not any(isinstance(t, ShardTensor) and not t._place.is_replicate() for t in _tensors(args, kwargs)):
            _mark_results(func, args, out)  # an op on rows: the rules made its result (a sum over rows is the whole)
        return out


_COLLECTIVES = ("c10d", "_c10d_functional")


def _mark_results(func, args, out) -> None:
    """Every result of an op on plain and replicated tensors with a rank-local operand is
    rank-local; an in-place op's target, and its base, too."""
    targets = list(_outputs(out))
    if func.overloadpacket.__name__.endswith("_") and args and isinstance(args[0], torch.Tensor):
        targets += [args[0], args[0]._base] if args[0]._base is not None else [args[0]]
    for t in targets:
        mark_rank_local(t)


@contextlib.contextmanager
def factory_rows(ctx):
    """NOTE [aten factories]; ``ctx``: the forward's HaloContext."""
    ctx.local_rows_taken = False  # NOTE [rank-local values]: set by mlipdd.shard.local() of rows
    with _FactoryRows(ctx):
        yield
