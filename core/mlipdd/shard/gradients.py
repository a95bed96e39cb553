"""Gradients taken inside the forward (``torch.autograd.grad``): where each one lives.

# NOTE [gradient layouts]
A gradient takes the layout of the tensor it is taken by: by atom or edge rows it is
rows of the same kind; by a replicated ShardTensor it is replicated (its uses by rows
summed their shares in the backward: NOTE [replicated gradients]); by a plain tensor
every rank shares (a strain, a cell, an electric field) it is THIS rank's share, to be
summed over ranks when returned (a stress in ``all_reduce_outputs``), never mistaken
for a replicated value that a rule already reduced.

# NOTE [partial rows]
Under halo storage a rank's atom rows are ``[owned | ghost copies]``. The gradient of the
energy by such rows (``torch.autograd.grad(E, positions)``: a force) holds, on each row,
only what reaches that atom through THIS rank's copy of it; an atom's derivative is the
sum over all its copies, which the strategy forms when the model returns the gradient
(`mlipdd.shard.exchange.halo_accumulate`). Until then even the owned rows are incomplete.

Ops that are linear and act row by row commute with that sum: a sign, a scale by a value
every copy shares, the sum of two such gradients, a view, a copy, a dtype change. Their
results stay partial and come out exact once returned. Any other op would compute on
incomplete rows (a force norm, a product of two gradients, a read by index, a sum over
the atoms, adding a constant) and is refused, naming the op.

Whether ghost rows are partial is what tells a model's own forces apart: forces that the
model assembled with a scatter (``index_add`` of edge-vector gradients) already hold the
owners' totals on every row, gradients by positions do not; `HaloStrategy.consolidate`
reads the placement, not the output's name.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from mlipdd.shard.placement import Opaque, describe, placement_of, tensor_args
from mlipdd.shard.propagation import NoRuleError, op_name

__all__ = ["LIVE", "check_outputs_in_graph", "check_partial_inputs", "is_partial", "mark_partial", "place_gradients", "remember"]

SHARE = Opaque("a gradient by a value every rank holds: this rank's share of it, summed over ranks when returned",
               None)


def place_gradients(grads, args, kwargs, meta):
    """``torch.autograd.grad``'s results, each in its input's layout (NOTE [gradient layouts])."""
    from mlipdd.shard.tensor import ShardTensor

    inputs = args[1] if len(args) > 1 else kwargs["inputs"]
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    rows = meta.as_rows()
    checked = rows.layout.is_checked()  # layouts that keep placements (NOTE [refuse by default])
    placed = []
    for g, x in zip(grads, inputs):
        if g is None:
            placed.append(None)
        elif getattr(x, "_meta", None) is None:
            placed.append(ShardTensor.wrap(g, rows, SHARE if checked else None))
        elif x._meta.layout.is_replicated():
            placed.append(ShardTensor.wrap(g, x._meta))
        else:
            place = placement_of(x) if checked else None
            if place is not None and place.kind == "atoms":
                place = replace(place, partial=True)
            placed.append(ShardTensor.wrap(g, x._meta, place))
    return type(grads)(placed)


def check_outputs_in_graph(args, kwargs, meta) -> None:
    """Refuse ``torch.autograd.grad`` of an output that does not depend on anything on
    this rank: its backward would skip the exchanges the other ranks' backward passes
    wait for, and torch's own error names no cause."""
    outputs = args[0] if args else kwargs["outputs"]
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    if all(o.requires_grad for o in outputs):
        return
    raise NoRuleError(
        f"the energy (or another differentiated output) does not depend on the inputs on this rank, "
        f"which holds {meta.n_owned} owned atoms; on one process it does, and the other ranks' "
        "backward passes wait for this rank's part of them. A per-atom result started as a fresh "
        "tensor (new_zeros, zeros) and filled only by masked writes (`out[mask] = net(h[mask])` per "
        "element) stays outside the autograd graph on a rank without atoms of those elements. Start "
        "it from the features (`out = h[:, 0] * 0`, then the masked writes), or gather the "
        "per-element results with index_add/scatter."
    )


# ids of live partial tensors (a weakref each): the check costs nothing while there are none
LIVE: dict[int, weakref.ref] = {}


def remember(t) -> None:
    key = id(t)
    LIVE[key] = weakref.ref(t, lambda _: LIVE.pop(key, None))


def is_partial(a) -> bool:
    place = getattr(a, "_place", None)
    if place is None or not place.partial:
        return False
    ref = LIVE.get(id(a))
    return ref is not None and ref() is a


def mark_partial(out):
    """Results of a linear op on partial rows are partial too (on every tensor of ``out``)."""
    if isinstance(out, (tuple, list)):
        for o in out:
            mark_partial(o)
        return out
    place = getattr(out, "_place", None)
    if place is not None and not place.partial:
        out._place = replace(place, partial=True)
    if place is not None:
        remember(out)
    return out


T = torch.Tensor
# one tensor in, each entry a fixed linear function of one entry (or a move of entries)
_ONE_INPUT = {T.neg, T.__neg__, torch.neg, T.negative, torch.negative, T.clone, torch.clone, T.detach,
              torch.detach, T.to, T.double, T.float, T.half, T.contiguous, T.view, T.view_as, T.reshape,
              torch.reshape, T.reshape_as, T.transpose, torch.transpose, T.t, torch.t, T.permute,
              torch.permute, T.unsqueeze, torch.unsqueeze, T.squeeze, torch.squeeze, T.flatten,
              torch.flatten, T.unflatten, T.cpu, T.cuda, T.requires_grad_, T.retain_grad,
              T.register_hook, T.unbind, torch.unbind, T.split, torch.split, T.chunk, torch.chunk}
_SUMS = {T.add, T.__add__, T.__radd__, T.__iadd__, T.add_, torch.add, T.sub, T.__sub__, T.__rsub__,
         T.__isub__, T.sub_, torch.sub, T.subtract, torch.subtract}
_SCALES = {T.mul, T.__mul__, T.__rmul__, T.__imul__, T.mul_, torch.mul, T.multiply, torch.multiply}
_DIVISIONS = {T.div, T.__truediv__, T.__itruediv__, T.div_, torch.div, T.divide, torch.divide}
_STACKS = {torch.stack, torch.cat, torch.concat, torch.concatenate}
# questions about the tensor, not new values
_DESCRIBE = {"__get__", "size", "dim", "numel", "stride", "__len__", "__repr__", "__format__",
             "is_floating_point", "is_complex", "element_size", "nelement", "is_contiguous",
             "data_ptr", "get_device", "type", "ndimension"}


def _linear_on_partial(func, args, kwargs, partial: list) -> bool:
    operands = list(tensor_args(args, kwargs))
    if func in _ONE_INPUT:  # others, if any, give a dtype or shape (x.to(y), x.view_as(y))
        return len(partial) == 1 and bool(args) and args[0] is partial[0]
    if func in _SUMS or func in _STACKS:  # every term partial: adding anything else to one copy is wrong
        return all(is_partial(a) for a in operands)
    if func in _SCALES:  # by a value every copy of the atom shares: not by stale ghost rows
        return len(partial) == 1 and not any(getattr(getattr(a, "_place", None), "stale", False) for a in operands)
    if func in _DIVISIONS:
        return len(partial) == 1 and args and args[0] is partial[0]
    if func is T.__getitem__:
        index = args[1] if len(args) > 1 else None
        items = index if isinstance(index, tuple) else (index,)
        return not any(isinstance(i, (torch.Tensor, list)) for i in items)  # slices and ints only
    return False


def check_partial_inputs(func, args, kwargs) -> bool:
    """True when the op takes partial rows (its results are then partial: `mark_partial`);
    raises `NoRuleError` when it is not a linear row-wise op (NOTE [partial rows])."""
    partial = [a for a in tensor_args(args, kwargs) if is_partial(a)]
    if not partial:
        return False
    if getattr(func, "__name__", "") in _DESCRIBE or _linear_on_partial(func, args, kwargs, partial):
        return True
    raise NoRuleError(
        f"`{op_name(func)}` on a gradient by halo atom rows ({describe(partial[0]._place)}): each of "
        "its rows holds only what reaches the atom through this rank's copy of it (NOTE [partial "
        "rows] in mlipdd.shard.gradients), so anything but a sign, a scale, a sum of gradients or a "
        "view of it computes on incomplete rows. Return the gradient from the model (mlipdd sums "
        "the copies into their owners) and compute this from the model's outputs, or run the "
        "model under the sharded strategy (DomainConfig(strategy='sharded')), where gradients of "
        "owned rows are complete."
    )
