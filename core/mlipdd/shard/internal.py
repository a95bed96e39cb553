"""mlipdd's own tensors, left plain by the aten factory mode (NOTE [internal factories]).

# NOTE [internal factories]
While a model runs under a spatial strategy, every factory's result is a replicated
ShardTensor (NOTE [aten factories] in `mlipdd.shard.aten.factories`), ``x.new_zeros(n)``
and ``torch.zeros_like(x)`` of a plain ``x`` (a parameter) included: a model that fills
one in place by the edge index gets atom rows. mlipdd's own code runs inside that scope
too, where no rule calls it: the halo exchanges' autograd functions (their backward runs
in the model's ``autograd.grad``), graph partition's gathers, a plugin's exchange through
`all_to_all_rows`. Its tensors must stay plain: a ShardTensor is no c10d buffer
(``all_gather_single`` raises a TypeError on one), and a replicated wrapper returned as a
plain gradient would carry the dispatch into the plain graph below. So that code runs
under `internal`: a per-thread depth the factory mode reads, under which it leaves every
factory's result plain. A rule needs no marking: the mode is off while a ShardTensor's
``__torch_dispatch__`` runs (torch pops a mode during its own handler, and a rule runs
inside the mode's ``func(...)``).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

__all__ = ["internal", "internal_scope", "is_internal"]

_DEPTH = threading.local()


def is_internal() -> bool:
    """Whether mlipdd's own code is running on this thread (NOTE [internal factories])."""
    return getattr(_DEPTH, "n", 0) > 0


@contextlib.contextmanager
def internal_scope():
    _DEPTH.n = getattr(_DEPTH, "n", 0) + 1
    try:
        yield
    finally:
        _DEPTH.n -= 1


def internal(fn):
    """Decorator: ``fn`` is mlipdd's own code; its factories stay plain (NOTE [internal factories])."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if torch.compiler.is_compiling():  # traced code runs no factory mode: nothing to mark
            return fn(*args, **kwargs)
        with internal_scope():
            return fn(*args, **kwargs)

    return wrapped
