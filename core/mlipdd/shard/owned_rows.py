"""Plain per-atom tensors created inside a sharded forward become owned rows.

# NOTE [row counts]
Under sharded storage a rank holds only its owned rows, and the dispatch routes a
read of another rank's row only on a ShardTensor. A model written the ordinary way
starts its state with ``torch.zeros(n_atoms, F)``: a plain tensor the dispatch never
sees, so ``state[sender]`` would index past its end. Two pieces make it owned rows:

1. `RowCount`: the leading size of sharded owned atom rows, read through ``.shape`` or
   ``.size()`` (``batch.num_atoms`` included), is an ``int`` that remembers the layout
   it counts (rule ``row_count``, `mlipdd.shard.counts`). Arithmetic on it gives a
   plain `LocalCount`, so only the count itself carries the layout (``len()`` and
   ``int()`` give plain ints: Python converts their results).
2. `owned_rows_scope`: while the sharded forward runs, a factory (``torch.zeros``,
   ``ones``, ``empty``, ``full``, ``rand``, ``randn``, ``Tensor.new_*``, and
   ``expand`` / ``broadcast_to`` of a plain tensor) whose leading size is a `RowCount`
   returns a ShardTensor of owned rows (NOTE [patched factories]).

A leading size that merely equals the owned row count (a plain int: ``int(n)``, a
count read from a plain tensor) is not trusted: it may be a feature width that
matches on this rank only, and ranks guessing differently would issue different
collectives. Such a tensor stays plain; its creation site is remembered, and a read
of a remote row from it, or a scatter into one (an index past the owned rows), raises
`UninferredRowsError` naming that site, the line of the read and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from mlipdd.shard.counts import RowCount
from mlipdd.shard.placement import ATOMS
from mlipdd.shard.propagation import NoRuleError, failed_on_rank
from mlipdd.shard.tensor import PATCHED, ShardMeta, ShardTensor

__all__ = ["RowCount", "UninferredRowsError", "owned_rows_scope"]


class UninferredRowsError(IndexError):
    """A plain tensor with this rank's owned row count was read at another rank's row."""


# ---- 2. factories inside the forward ----------------------------------------------------
# NOTE [patched factories]: a torch-function mode would see these calls too, but it puts
# a Python call in front of every op of the forward (a pass-through mode: +14 %
# to +21 % CPU time on a small charge-equilibration forward, benchmarks/sharded_owned_rows.py).
# Instead the few factories are wrapped while a sharded forward runs (+8 % on the same
# forward, from re-assigning them on entry and exit) and given back after it, so torch
# is unchanged outside (torch.jit.script, fx). The wrappers act only in the context that
# entered the scope (a ContextVar): another thread gets torch's own result.
_TORCH_FACTORIES = ("zeros", "ones", "empty", "full", "rand", "randn")
_FROM_TENSOR = ("broadcast_to",)  # torch.f(tensor, size): sizes after a tensor
_TENSOR_METHODS = ("new_zeros", "new_ones", "new_empty", "new_full", "expand")

# where a creation site is not the model's: torch itself, and the core's distributed layers
_TORCH = os.path.dirname(torch.__file__) + os.sep
_MLIPDD = os.path.dirname(sys.modules["mlipdd"].__file__)
_CORE = tuple(os.path.join(_MLIPDD, layer) + os.sep for layer in ("shard", "strategy", "distributed", "spec"))


class _Scope:
    """One sharded forward: its layout and the plain n_owned-row tensors the model made."""

    def __init__(self, meta: ShardMeta):
        self.meta = meta
        self.sites: list[str] = []

    def remember(self) -> None:
        frame = sys._getframe(2)  # the code that called the factory
        if frame.f_code.co_filename.startswith((_TORCH, *_CORE)):
            return  # torch's or the core's own bookkeeping, not the model
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        site = f"{frame.f_code.co_filename}:{frame.f_lineno} ({line})"
        if site not in self.sites:
            self.sites.append(site)


_ACTIVE: ContextVar[_Scope | None] = ContextVar("mlipdd_owned_rows", default=None)


def _leading_size(sizes: tuple, kwargs: dict):
    first = kwargs["size"] if "size" in kwargs else (sizes[0] if sizes else None)
    if isinstance(first, (tuple, list)):
        first = first[0] if first else None
    return first


def _owned_rows_factory(original, skip: int):
    """``original`` (a factory), returning owned rows when given a RowCount; ``skip``
    leading arguments come before the sizes (the tensor of ``x.new_zeros``)."""

    @functools.wraps(original)
    def factory(*args, **kwargs):
        out = original(*args, **kwargs)
        scope = _ACTIVE.get()
        if scope is None or type(out) is not torch.Tensor or out.dim() == 0:
            return out
        size = _leading_size(args[skip:], kwargs)
        if isinstance(size, RowCount):
            return ShardTensor.wrap(out, size.meta, ATOMS)
        if size == scope.meta.n_owned and size != scope.meta.n_edges:
            scope.remember()
        return out

    return factory


_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0
_SAVED: list[tuple[object, str, object]] = []


def _install() -> None:
    """Wrap the factories (the outermost of nested or concurrent scopes does)."""
    global _PATCH_DEPTH
    with _PATCH_LOCK:
        _PATCH_DEPTH += 1
        if _PATCH_DEPTH > 1:
            return
        targets = [(torch, name, 0) for name in _TORCH_FACTORIES]
        targets += [(torch, name, 1) for name in _FROM_TENSOR]
        targets += [(torch.Tensor, name, 1) for name in _TENSOR_METHODS]
        for owner, name, skip in targets:
            _SAVED.append((owner, name, owner.__dict__.get(name)))
            original = getattr(owner, name)
            wrapper = _owned_rows_factory(original, skip)
            setattr(owner, name, wrapper)
            PATCHED[wrapper] = original  # NOTE [patched methods] in mlipdd.shard.tensor


def _uninstall() -> None:
    """Give torch its own factories back (the last scope out does)."""
    global _PATCH_DEPTH
    with _PATCH_LOCK:
        _PATCH_DEPTH -= 1
        if _PATCH_DEPTH > 0:
            return
        for owner, name, saved in reversed(_SAVED):
            if saved is None:
                delattr(owner, name)  # the method lives on a base class (TensorBase)
            else:
                setattr(owner, name, saved)
        _SAVED.clear()
        PATCHED.clear()


def _is_row_index_error(exc: BaseException, scope: _Scope) -> bool:
    """An index past the owned rows: torch names the size (indexing, scatter_add, gather),
    or, for index_select / index_add, does not, and then only a remembered site tells."""
    text = str(exc)
    return isinstance(exc, (IndexError, RuntimeError)) and not isinstance(exc, UninferredRowsError) and (
        f"with size {scope.meta.n_owned}" in text or ("index out of range in self" in text and bool(scope.sites))
    )


def _read_site(exc: BaseException) -> str:
    """The model's line where the failing read or scatter happened (last frame outside torch/core)."""
    where = ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        name = frame.f_code.co_filename
        if not name.startswith((_TORCH, *_CORE)):
            where = f"{name}:{lineno} ({linecache.getline(name, lineno).strip()})"
    return where


def _message(exc: BaseException, scope: _Scope) -> str:
    meta = scope.meta
    if scope.sites:
        origin = "was created with a plain int size at " + "; or ".join(scope.sites)
    else:
        origin = "was computed from plain tensors only (not from the model's inputs)"
    read = _read_site(exc)
    return (
        f"{exc}{f' at {read}' if read else ''}: under sharded storage this rank holds its "
        f"{meta.n_owned} owned atoms, and rows past them belong to other ranks. The plain tensor "
        f"indexed there has {meta.n_owned} rows and {origin}, so mlipdd cannot tell that it holds "
        "atom rows and route the read or scatter. Create it from an input so it is sharded like the "
        "inputs: torch.zeros_like(h) or positions.new_zeros(n, ...), or take its size as "
        "n = batch.num_atoms / positions.shape[0] (not int(...) or len(...), which drop the row layout)"
    )


@contextlib.contextmanager
def owned_rows_scope(meta: ShardMeta) -> Iterator[None]:
    """Around a sharded forward: factories given a `RowCount` make owned rows, and a read
    of a remote row from a plain tensor is explained (NOTE [row counts])."""
    scope = _Scope(meta)
    token = _ACTIVE.set(scope)
    _install()
    try:
        yield
    except (IndexError, RuntimeError) as exc:
        if _is_row_index_error(exc, scope):
            raise UninferredRowsError(_message(exc, scope)) from exc
        if getattr(exc, "mlipdd_op", None):  # NOTE [failed on this rank] in propagation
            read = _read_site(exc)
            raise NoRuleError(failed_on_rank(exc, scope.meta.n_owned, f" at {read}" if read else "")) from exc
        raise
    finally:
        _uninstall()
        _ACTIVE.reset(token)
