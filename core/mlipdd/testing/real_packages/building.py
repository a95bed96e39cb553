"""Building a package's model the same way on every rank."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def seeded_build(seed: int | None, dtype: torch.dtype | None = None):
    """Random weights from ``seed`` (None: the package seeds itself) without touching the
    caller's RNG, optionally under default dtype ``dtype`` (e3nn's generated code keeps
    constants of the default dtype); the caller's default dtype is back afterwards, whatever
    the package set."""
    default = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(default)
