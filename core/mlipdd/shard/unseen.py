"""Rows computed where the dispatch could not see them: what is refused.

# NOTE [unseen computation]
Two ways a model computes on rows without `ShardTensor.__torch_function__` seeing it:

* a TorchScript function (``@torch.jit.script``, as schnetpack and matgl write their
  scatter helpers) runs on the plain data and returns a PLAIN tensor; inside a
  distributed forward it runs as the Python it was scripted from instead, and a method
  of a scripted module is refused (NOTE [scripted functions] in `mlipdd.shard.scripted`);
* an ``autograd.Function`` with a hand-written backward: its forward runs under the
  dispatch (so the forward values are exact) but with grad mode off, and its backward
  runs in the autograd engine, outside it. A rule that moves values across rows (a
  scatter, a read by index, a reduction) firing with grad mode off on an input that
  requires grad marks its result; if the result comes back requiring grad, autograd
  attached a hand-written backward to it, which would miss the other ranks' shares.
  (Under ``torch.no_grad()`` the result needs no gradient and stays usable.)

The second raises `NoRuleError`, on every rank through ``fail_together``.
"""

from __future__ import annotations

import torch

from mlipdd.shard.placement import tensor_args
from mlipdd.shard.propagation import NoRuleError, op_name

__all__ = ["check_unseen", "mark_by_hand"]


def _has_history(t: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return t.requires_grad and t.grad_fn is not None


def mark_by_hand(out, rule: str, args, kwargs) -> None:
    """Called after ``rule`` fired: mark its results if it ran inside a hand-differentiated forward."""
    if torch.is_grad_enabled():
        return
    inputs = list(tensor_args(args, kwargs))
    if not any(_requires_grad(a) for a in inputs):
        return
    for o in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(o, torch.Tensor) and hasattr(o, "_meta") and not any(o is a for a in inputs):
            o._by_hand = rule


def _requires_grad(t) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return t.requires_grad


def check_unseen(func, args, kwargs) -> None:
    for a in tensor_args(args, kwargs):
        if getattr(a, "_by_hand", None) is not None and _has_history(a):
            with torch._C.DisableTorchFunctionSubclass():
                backward = type(a.grad_fn).__name__
            raise NoRuleError(
                f"`{op_name(func)}` takes the output of an autograd.Function ({backward}) whose forward "
                f"moved values across rows (`{a._by_hand}`): its hand-written backward runs outside the "
                "dispatch, so the forces through it would miss the other ranks' shares (NOTE [unseen "
                "computation] in mlipdd.shard.unseen). Write it with plain torch ops and let autograd "
                "derive the backward, or make it a torch.library custom op with an OpAdapter in the "
                "model's DistributionSpec, or use the graph_partition strategy."
            )
