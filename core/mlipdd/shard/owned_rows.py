"""Plain per-atom tensors created inside a sharded forward become owned rows.

# NOTE [row counts]
Under sharded storage a rank holds only its owned rows, and the dispatch routes a
read of another rank's row only on a ShardTensor. A model written the ordinary way
starts its state with ``torch.zeros(n_atoms, F)``: a plain tensor the dispatch never
sees, so ``state[sender]`` would index past its end. Two pieces make it owned rows:

1. `RowCount`: the leading size of a sharded ShardTensor, read through ``.shape``,
   ``.size()`` or ``len()`` (``batch.num_atoms`` included), is an ``int`` that
   remembers the layout it counts (rule ``sharded_row_count``). Arithmetic on it
   gives a plain int again, so only the count itself carries the layout.
2. `OwnedRowsMode`: while the sharded forward runs, a factory (``torch.zeros``,
   ``ones``, ``empty``, ``full``, ``rand``, ``randn``, ``Tensor.new_*``, and
   ``expand`` / ``broadcast_to`` of a plain tensor) whose leading size is a `RowCount`
   returns a ShardTensor of owned rows.

A leading size that merely equals the owned row count (a plain int: ``int(n)``, a
count read from a plain tensor) is not trusted: it may be a feature width that
matches on this rank only, and ranks guessing differently would issue different
collectives. Such a tensor stays plain; its creation site is remembered, and a read
of a remote row from it raises `UninferredRowsError` naming that site and the fix.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import weakref
from collections.abc import Iterator
from typing import Self

import torch
from torch.overrides import TorchFunctionMode

from mlipdd.shard.layouts import Sharded
from mlipdd.shard.registry import register
from mlipdd.shard.tensor import ShardMeta, ShardTensor

__all__ = ["OwnedRowsMode", "RowCount", "UninferredRowsError", "owned_rows_scope"]


class RowCount(int):
    """This rank's number of owned atom rows, remembering their layout (NOTE [row counts])."""

    meta: ShardMeta

    def __new__(cls, value: int, meta: ShardMeta) -> Self:
        count = super().__new__(cls, value)
        count.meta = meta
        return count

    def __reduce__(self):
        return int, (int(self),)  # pickled (sent, saved) as the plain number


class UninferredRowsError(IndexError):
    """A plain tensor with this rank's owned row count was read at another rank's row."""


# ---- 1. counts that remember their layout ---------------------------------------------
_SHAPE = torch.Tensor.shape.__get__
_COUNTS = (_SHAPE, torch.Tensor.size, torch.Tensor.__len__)


def _counts_sharded_rows(func, meta, args, kwargs) -> bool:
    x = args[0] if args else None
    return isinstance(x, ShardTensor) and x._meta.layout.is_sharded()


@register(Sharded, *_COUNTS, name="sharded_row_count", predicate=_counts_sharded_rows)
def sharded_row_count(func, meta, args, kwargs):
    """The leading size of owned rows as a RowCount (factories given it make owned rows)."""
    x = args[0]
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
        ndim = x.dim()
    n_owned = x._meta.n_owned
    if isinstance(out, torch.Size):
        if ndim and out[0] == n_owned:
            return torch.Size((RowCount(out[0], x._meta), *out[1:]))
        return out
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if ndim and dim in (0, -ndim) and out == n_owned:
        return RowCount(out, x._meta)
    return out


# ---- 2. factories inside the forward ----------------------------------------------------
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn}
# sizes after a first tensor argument: x.new_zeros(n, F), w.expand(n, F), broadcast_to(w, (n, F))
_NEW_FACTORIES = {torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full,
                  torch.Tensor.expand, torch.broadcast_to}
_READS = {torch.Tensor.__getitem__, torch.Tensor.index_select, torch.index_select, torch.Tensor.gather,
          torch.gather}
# where a creation site is not the model's: torch itself, and the core's distributed layers
_TORCH = os.path.dirname(torch.__file__) + os.sep
_MLIPDD = os.path.dirname(sys.modules["mlipdd"].__file__)
_CORE = tuple(os.path.join(_MLIPDD, layer) + os.sep for layer in ("shard", "strategy", "distributed", "spec"))


def _leading_size(func, args, kwargs):
    sizes = args[1:] if func in _NEW_FACTORIES else args
    first = kwargs["size"] if "size" in kwargs else (sizes[0] if sizes else None)
    if isinstance(first, (tuple, list)):
        first = first[0] if first else None
    return first


class OwnedRowsMode(TorchFunctionMode):
    """Owned rows for factories given a `RowCount`; a clear error for the ones that were not."""

    def __init__(self, meta: ShardMeta):
        super().__init__()
        self.meta = meta
        self.sites: dict[int, tuple[weakref.ref, str]] = {}  # plain tensors of n_owned rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS and args and type(args[0]) is torch.Tensor:
            return self._read(func, args, kwargs)
        out = func(*args, **kwargs)
        if (func in _FACTORIES or func in _NEW_FACTORIES) and type(out) is torch.Tensor and out.dim():
            size = _leading_size(func, args, kwargs)
            if isinstance(size, RowCount):
                return ShardTensor.wrap(out, size.meta)
            if size == self.meta.n_owned and size != self.meta.n_edges:
                self._remember(out, func)
        return out

    def _remember(self, tensor: torch.Tensor, func) -> None:
        frame = sys._getframe(2)  # the code that called the factory
        while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
            frame = frame.f_back
        if frame is None or frame.f_code.co_filename.startswith(_CORE):
            return  # the core's own bookkeeping (exchanges, their backward), not the model
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        key = id(tensor)
        self.sites[key] = (weakref.ref(tensor, lambda _: self.sites.pop(key, None)), f"{where} ({line})")

    def _read(self, func, args, kwargs):
        try:
            return func(*args, **kwargs)
        except (IndexError, RuntimeError) as exc:
            x = args[0]
            if x.dim() == 0 or x.shape[0] != self.meta.n_owned or "out of" not in str(exc):
                raise
            entry = self.sites.get(id(x))
            site = entry[1] if entry is not None and entry[0]() is x else None
            raise UninferredRowsError(_message(x, self.meta, site, exc)) from exc


def _message(x: torch.Tensor, meta: ShardMeta, site: str | None, exc: Exception) -> str:
    origin = (
        f"created at {site} with a plain int size" if site is not None
        else "computed from plain tensors only (not from the model's inputs)"
    )
    return (
        f"{exc}: under sharded storage this rank holds its {meta.n_owned} owned atoms, and rows "
        f"past them belong to other ranks. This plain tensor of {x.shape[0]} rows was {origin}, "
        "so mlipdd cannot tell that it holds atom rows and route the read. Create it from an "
        "input so it is sharded like the inputs: torch.zeros_like(h) or positions.new_zeros(n, ...), "
        "or take its size as n = batch.num_atoms / positions.shape[0] (not int(...) of it, which "
        "drops the row layout)"
    )


@contextlib.contextmanager
def owned_rows_scope(meta: ShardMeta) -> Iterator[OwnedRowsMode]:
    """Around a sharded forward: factories given a `RowCount` make owned rows."""
    with OwnedRowsMode(meta) as mode:
        yield mode
