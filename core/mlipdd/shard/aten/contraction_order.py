"""Contraction orders that never depend on this rank's sizes: left to right over rows.

# NOTE [contraction order]
``torch.einsum`` with three or more operands asks opt_einsum for a contraction path, and
opt_einsum chooses it from the operands' SHAPES; ``torch.linalg.multi_dot`` (and
``chain_matmul``) orders its products by the matrices' shapes too. A ShardTensor has this
rank's LOCAL shape, so ranks holding different numbers of rows contract in different
orders. Each order is exact (a product over the rows is a local sum + all_reduce), but
the ranks then issue different collectives and gloo waits forever: WholeSystemMPNN's
``einsum("n,nk,k->", charges, features, readout)`` at 4 ranks under sharded storage, where
a rank owning 12 atoms contracted the rows first (an all_reduce of a (1, 1, 8) partial)
and ranks owning 6 the features first (one of (1, 1, 1)): a hang on every rank.

So under the spatial strategies (the torch-function mode of NOTE [aten means] calls this)
a product of three or more factors over rows contracts LEFT TO RIGHT on every rank:
einsum without an opt_einsum path (torch's own order then, which sums each letter as
soon as no later operand and not the output has it) and multi_dot as a chain of
matmuls. That is also the order a rank holding a single row spells its einsum in (NOTE
[a single row] in `mlipdd.shard.aten.one_row_einsum`), so its sums over the rows meet
its peers' all_reduce for all_reduce. One process may pick another order: the values
agree to rounding, the cost of a bad order is the price of ranks that stay in step.
"""

from __future__ import annotations

import functools

import torch

from mlipdd.shard.aten.placement import Rows
from mlipdd.shard.aten.tensor import ShardTensor

__all__ = ["ORDERED", "ordered_contraction"]


def _rows(x):
    return x._place if isinstance(x, ShardTensor) and isinstance(x._place, Rows) else None


def _einsum(args, kwargs):
    equation, *operands = args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    opt = torch.backends.opt_einsum
    if len(operands) <= 2 or not (opt.enabled and opt.is_available()) or not any(map(_rows, operands)):
        return NotImplemented  # torch asks for no path: left to right already
    return torch._VF.einsum(equation, operands)  # no path: left to right


def _left_to_right(args, kwargs):
    matrices = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)
    if kwargs.get("out") is not None or len(matrices) <= 2 or not any(map(_rows, matrices)):
        return NotImplemented
    # multi_dot's 1-D first and last operands are matmul's row and column vectors
    return functools.reduce(torch.matmul, matrices)


ORDERED = {torch.einsum: _einsum, torch.linalg.multi_dot: _left_to_right, torch.chain_matmul: _left_to_right}


def ordered_contraction(func, args, kwargs):
    """NOTE [contraction order]: ``func``'s result, or NotImplemented when torch's own call is rank-independent."""
    return ORDERED[func](args, kwargs) if func in ORDERED else NotImplemented
