"""Evaluating mace on a rank that holds no atom rows.

Under sharded storage a rank keeps only the atoms it owns, and a rank may own none: a
slab's vacuum, a cell with fewer atom planes than ranks. It must still run the model:
every routed read and per-system sum is a collective the other ranks wait in. mace's
layers take zero rows, except the symmetric contraction, whose optimised einsum reshapes
to ``(rows, -1)`` (ambiguous for zero rows). `empty_rows_guard` evaluates each
contraction on one zero row and keeps none of it, for one forward of a rank without
rows; other calls never enter it. It is the old (torch-function) dispatch's: under the aten
dispatch the contraction runs on the zero rows themselves (its ``view(0, -1)`` is sized
like the peers', `mlipdd.shard.aten.rules._sizes_of_no_rows`), and this ShardTensor class
is not the aten one, so the guard steps aside.
"""

from __future__ import annotations

import contextlib

import torch


def _contraction_on_no_rows(contraction):
    """The contraction as it is: the one-row padding this guard did applied to the
    torch-function dispatch's rows only (deleted, issue 21); the aten dispatch runs mace's
    contraction on zero rows itself (NOTE [a rank owning no atom])."""
    return contraction.forward


@contextlib.contextmanager
def empty_rows_guard(model: torch.nn.Module):
    """While active, mace's symmetric contractions accept zero rows (module docstring)."""
    from mace.modules.symmetric_contraction import SymmetricContraction

    guarded = [m for m in model.modules() if isinstance(m, SymmetricContraction)]
    for m in guarded:
        m.forward = _contraction_on_no_rows(m)  # an instance attribute shadows the class's
    try:
        yield
    finally:
        for m in guarded:
            del m.forward  # back to the class's own forward
