"""Host values of device tensors, read once while the tensors stay the same (GPU dynamics)."""

from __future__ import annotations

import weakref

import torch


class HostReads:
    """Host values computed from device tensors, kept while those same tensors are unchanged.

    On a GPU every host read of a tensor waits for the device; in dynamics the atomic numbers,
    charges, pbc and system index stay the same tensor objects from step to step, so a check or
    a size read from them once holds until one is replaced or written in place (its
    ``_version`` moves). ``also``: plain values the result depends on as well. Only for plain
    tensors at one process: under DD a rank that skips a reduction another rank takes would hang.
    """

    def __init__(self):
        self._memo = {}

    def get(self, name: str, tensors: tuple, compute, also: tuple = ()):
        if torch.compiler.is_compiling():  # no Python state inside a trace
            return compute()
        versions = tuple(t._version for t in tensors) + tuple(also)
        hit = self._memo.get(name)
        if hit is not None and hit[1] == versions and all(r() is t for r, t in zip(hit[0], tensors)):
            return hit[2]
        value = compute()
        self._memo[name] = ([weakref.ref(t) for t in tensors], versions, value)
        return value
