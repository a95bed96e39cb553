"""`ShardTensor`: a torch.Tensor subclass whose dispatch performs the cross-rank work.

The data is this rank's rows, plain and zero-copy; the metadata (`ShardMeta`) says
what the rows are (its `Layout`: ``[owned | ghost]`` for halo storage, owned rows for
sharded storage, ...) and how to exchange them (`ExchangePlan`). On every torch op
with a ShardTensor argument, `__torch_function__` asks the registry for the rule of
the call's layout and op (scatter into node rows -> halo correction, per-system
scatter -> local sum + all_reduce, ...; NOTE [precedence] in ``registry``) and
otherwise runs the op as usual and re-attaches the metadata to the outputs.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field

import torch

from mlipdd.shard import gradients as partial
from mlipdd.shard import registry, unseen
from mlipdd.shard.counts import refuse_count_values
from mlipdd.shard.exchange import ExchangePlan, halo_fill
from mlipdd.shard.layouts import HALO, Layout, Replicated
from mlipdd.shard.placement import ATOMS, EDGES, Rows, tensor_args
from mlipdd.shard.propagation import explain_failure, output_placement


@dataclass(frozen=True)
class ShardMeta:
    """What one rank's rows mean; shared by every ShardTensor of one forward pass."""

    plan: ExchangePlan
    n_systems: int
    n_edges: int = -1  # rows of edge-shaped tensors (each edge lives on one rank)
    layout: Layout = HALO
    group: object = None
    notes: dict = field(default_factory=dict, compare=False)

    @property
    def n_owned(self) -> int:
        return self.plan.n_owned

    @property
    def n_padded(self) -> int:
        """Rows of a per-atom (node) tensor in this layout; -1 when it has none."""
        return self.layout.node_rows(self.plan)

    @property
    def system_reductions(self) -> bool:
        return self.layout.system_reductions

    def row_kind(self, rows: int) -> str:
        """``node`` (per-atom rows of this layout), ``edge`` (unique rows) or ``other``."""
        if self.layout.is_replicated():
            return "other"
        if rows == self.n_padded:
            return "node"
        if rows == self.n_edges:
            return "edge"
        return "other"

    def as_replicated(self) -> ShardMeta:
        """The metadata of a value reduced over ranks from rows of this layout."""
        if self.layout.is_replicated():
            return self
        return dataclasses.replace(self, layout=Replicated(source=self.layout))

    def as_rows(self) -> ShardMeta:
        """The row layout a replicated value came from (itself for rows)."""
        if not self.layout.is_replicated():
            return self
        return dataclasses.replace(self, layout=self.layout.source)


class DroppedScatterResultError(RuntimeError):
    """An in-place scatter's return value was dropped under domain decomposition."""


# NOTE [patched methods]
# While a sharded forward runs, `mlipdd.shard.owned_rows` replaces a few factories and
# methods (``Tensor.expand``, ``Tensor.new_zeros``) by wrappers; torch then hands the
# WRAPPER to ``__torch_function__`` (it looks the method up on the class by name), so a
# rule keyed on ``Tensor.expand`` would never fire (a replicated global state expanded to
# the atoms got no cross-rank gradient: forces 26 % off). The dispatch sees the original.
PATCHED: dict = {}  # wrapper -> the torch function it wraps, while the wrappers are installed

# Accumulators whose in-place scatter was answered with a new tensor (see `poison`),
# keyed by id (tensor ``==`` is elementwise, so no WeakSet) with a weakref to the object.
_STALE: dict[int, weakref.ref] = {}


def poison(accumulator: torch.Tensor, op_name: str) -> None:
    """Mark the target of an in-place scatter that the dispatch answered out of place.

    # NOTE [dropped rebind]
    A cross-rank scatter cannot keep in-place semantics, so the handler returns a new
    tensor. Code that ignores the return keeps using the old accumulator; we fill it
    with NaN (a loud, never silently plausible value) and remember it, so its next use
    next to a ShardTensor raises with the fix.
    """
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        if accumulator.is_floating_point():
            accumulator.fill_(float("nan"))
    key = id(accumulator)
    _STALE[key] = weakref.ref(accumulator, lambda _: _STALE.pop(key, None))
    accumulator._mlipdd_dropped_op = op_name


def dropped_rebind_message(op_name: str) -> str:
    return (
        f"the result of an in-place `{op_name}` was dropped: under domain decomposition the "
        "cross-rank scatter returns a NEW tensor and the old one is stale. Rebind it: write "
        f"`x = x.{op_name}(...)` instead of `x.{op_name}(...)` (single-process this is a no-op)."
    )


def _check_stale(args, kwargs) -> None:
    for a in tensor_args(args, kwargs):
        ref = _STALE.get(id(a))
        if ref is not None and ref() is a:
            raise DroppedScatterResultError(dropped_rebind_message(getattr(a, "_mlipdd_dropped_op", "scatter_add_")))



def find_meta(args, kwargs) -> ShardMeta | None:
    """The call's layout: the first ShardTensor holding rows, else the first replicated one
    (a replicated value next to rows is used per row: NOTE [replicated gradients])."""
    replicated = None
    for a in tensor_args(args, kwargs):
        if isinstance(a, ShardTensor):
            if not a._meta.layout.is_replicated():
                return a._meta
            replicated = replicated or a._meta
    return replicated


def local(t):
    """The plain tensor behind a ShardTensor (same data, same autograd history); the public
    form, which also takes the aten dispatch's tensors, is `mlipdd.shard.declared.local`."""
    if isinstance(t, ShardTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return t.as_subclass(torch.Tensor)
    return t


def promote(out, meta: ShardMeta, place=None):
    """Wrap ``out`` (a tensor, or a tuple/list of them) with ``meta``; ``place``: the
    placement of every tensor in it, or a list of one per element (None: from the row
    count, NOTE [placements] in `mlipdd.shard.placement`)."""
    if isinstance(out, ShardTensor):
        if getattr(out, "_meta", None) is None:
            out._meta = meta
        if place is not None and not isinstance(place, list):
            _set_place(out, meta, place)
        return out
    if isinstance(out, torch.Tensor):
        return ShardTensor.wrap(out, meta, place)
    if isinstance(out, (tuple, list)):
        places = place if isinstance(place, list) else [place] * len(out)
        return type(out)([promote(o, meta, p) for o, p in zip(out, places)])
    return out


def _set_place(out, meta: ShardMeta, place) -> None:
    if place is not None and place.partial:
        if meta.layout.is_halo():
            partial.remember(out)  # NOTE [partial rows]: ops on it are checked from now on
        else:  # sharded rows have no ghost copies: a gradient of owned rows is complete
            place = dataclasses.replace(place, partial=False)
    out._place = place


class ShardTensor(torch.Tensor):
    _meta: ShardMeta

    _place = None  # `mlipdd.shard.placement`: where this tensor's rows are
    _by_hand = None  # a rule that made it inside an autograd.Function (NOTE [unseen computation])

    @staticmethod
    def wrap(tensor: torch.Tensor, meta: ShardMeta, place=None) -> ShardTensor:
        """Promote a plain tensor (this rank's rows) to a ShardTensor; zero-copy.
        ``place``: its placement (None: from its dim-0 row count when first asked)."""
        with torch._C.DisableTorchFunctionSubclass():
            out = tensor.as_subclass(ShardTensor)
        out._meta = meta
        _set_place(out, meta, place)
        return out

    @property
    def meta(self) -> ShardMeta:
        return self._meta

    def local(self) -> torch.Tensor:
        return local(self)

    def owned(self) -> torch.Tensor:
        """The owned rows as a plain tensor."""
        return local(self)[: self._meta.n_owned]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if PATCHED:  # NOTE [patched methods]
            func = PATCHED.get(func, func)
        if _STALE:
            _check_stale(args, kwargs)
        # NOTE [partial rows]: only linear row-wise ops take a gradient by halo atom rows
        takes_partial = bool(partial.LIVE) and partial.check_partial_inputs(func, args, kwargs)
        if takes_partial:
            return partial.mark_partial(cls._dispatch(func, args, kwargs))
        return cls._dispatch(func, args, kwargs)

    @classmethod
    def _dispatch(cls, func, args, kwargs):
        meta = find_meta(args, kwargs)
        if meta is not None:
            if meta.layout.is_checked():  # NOTE [unseen computation]
                unseen.check_unseen(func, args, kwargs)
            rule = registry.lookup(func, meta, args, kwargs)
            if rule is not None:
                registry.FIRED[rule.name] += 1
                out = rule.handler(func, meta, args, kwargs)
                unseen.mark_by_hand(out, rule.name, args, kwargs)
                return out
        if func is torch.autograd.grad and meta is not None:
            partial.check_outputs_in_graph(args, kwargs, meta)
        with torch._C.DisableTorchFunctionSubclass():
            try:
                out = func(*args, **kwargs)
            except (RuntimeError, IndexError) as error:
                if meta is not None and type(error) in (RuntimeError, IndexError) and func is not torch.autograd.grad:
                    explain_failure(func, args, kwargs, error)  # NOTE [failed on this rank]
                raise
        if meta is None or func in _NO_PROMOTE:
            return out
        if func is torch.autograd.grad:
            return partial.place_gradients(out, args, kwargs, meta)  # NOTE [gradient layouts]
        if not _holds_tensors(out):  # shapes, dtypes, numbers, None
            if func is torch.Tensor.__setitem__ and meta.layout.is_checked():
                output_placement(func, args, kwargs, out)  # refuses rows written into a plain tensor
            return out
        if meta.layout.is_replicated() or not meta.layout.is_checked():
            if meta.layout.is_replicated() and meta.as_rows().layout.is_checked():
                refuse_count_values(func, args, kwargs, out)  # NOTE [counts are sizes]
            return promote(out, meta)
        # NOTE [refuse by default]: rows without a rule get a placement, or the op is refused
        return promote(out, meta, output_placement(func, args, kwargs, out))


def _holds_tensors(out) -> bool:
    if isinstance(out, torch.Tensor):
        return True
    return isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out)


# Results that describe a tensor rather than hold rows of it.
_NO_PROMOTE = {
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.numpy,
}


def refresh_ghosts(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its ghost rows replaced by their owners' values (a halo exchange whose
    backward sends the ghosts' gradients to their owners): for atom rows computed from a
    padded neighbour table, whose ghost rows are not current (NOTE [placements]). ``x``
    itself on one process, under sharded storage (no ghost rows) or for a plain tensor."""
    if not isinstance(x, ShardTensor) or not x._meta.layout.is_halo():
        return x
    return ShardTensor.wrap(halo_fill(local(x), x._meta.plan), x._meta, ATOMS)


def as_edge_rows(t: torch.Tensor, like: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Declare ``t`` as this rank's edge rows along ``dim`` (each edge computed on exactly
    one rank: its receiver's owner), in ``like``'s forward: for a model that builds its own
    graph over ``[owned | ghost]`` rows and keeps the edges of owned receivers. ``t``
    itself when ``like`` is not distributed."""
    if not isinstance(like, ShardTensor) or like._meta.layout.is_replicated():
        return t
    return ShardTensor.wrap(local(t), like._meta, Rows("edges", dim=dim))


def neighbors_as_edge_rows(neighbors, meta: ShardMeta):
    """A rank's neighbour list with its edge index and shifts as edge rows (ShardTensors),
    so the edges a model filters or gathers stay edges however it indexes them."""
    return dataclasses.replace(
        neighbors,
        edge_index=ShardTensor.wrap(neighbors.edge_index, meta, Rows("edges", dim=1, values="atoms")),
        unit_shifts=ShardTensor.wrap(neighbors.unit_shifts, meta, EDGES),
    )
