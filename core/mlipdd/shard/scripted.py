"""TorchScript functions called on rows run as the Python they were scripted from.

# NOTE [scripted functions]
A ``@torch.jit.script`` function (schnetpack's and matgl's scatter helpers) runs in the
TorchScript interpreter on the plain data of its ShardTensor arguments: no op in it
reaches ``ShardTensor.__torch_function__``, and it returns a PLAIN tensor. A scatter in
it sums this rank's edges alone; under halo storage the owned rows come out right and
the ghost rows stay zero, which the next layer reads by sender (forces 30-100 % off at
2-4 ranks, no error). Telling that plain result from a plain tensor a model may
legitimately mix with rows is a guess, so the call itself is where to act.

While a distributed forward runs (`script_functions_dispatched`, entered by the halo and
sharded strategies' model scope), a script function given a ShardTensor runs the Python
function it was compiled from (torch keeps it as ``_torchdynamo_inline``, for dynamo):
the same math, every op in it under the dispatch, so the result equals one process. A
script function without its Python (loaded by ``torch.jit.load``) is refused, naming it.
Calls with plain tensors, and every call outside the scope, go to TorchScript unchanged.
A scripted MODULE keeps no Python to run instead: a method of one (``torch.jit.script(
Interaction(...))``) called with a ShardTensor is refused before it runs, naming it
(run as is, its reads of remote rows under sharded storage fail deep in the interpreter).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from mlipdd.shard.placement import describe, placement_of, tensor_args
from mlipdd.shard.propagation import NoRuleError

__all__ = ["script_functions_dispatched"]

_SCRIPT_FUNCTION = torch.jit.ScriptFunction
_SCRIPT_METHOD = torch.ScriptMethod
_LOCK = threading.Lock()
_DEPTH = 0
_ORIGINAL_CALL = _SCRIPT_FUNCTION.__call__
_ORIGINAL_METHOD_CALL = _SCRIPT_METHOD.__call__

_FIX = ("so its scatters and reads would see this rank's rows alone (NOTE [scripted functions] in "
        "mlipdd.shard.scripted)")


def _rows_argument(args, kwargs):
    from mlipdd.shard.tensor import ShardTensor

    return next((a for a in tensor_args(args, kwargs) if isinstance(a, ShardTensor)), None)


def _call(self, *args, **kwargs):
    rows = _rows_argument(args, kwargs)
    if rows is None:
        return _ORIGINAL_CALL(self, *args, **kwargs)
    python = getattr(self, "_torchdynamo_inline", None)
    if python is None:
        raise NoRuleError(
            f"TorchScript function `{self.qualified_name}` called on {describe(placement_of(rows))}: it "
            f"runs in the TorchScript interpreter, outside mlipdd's dispatch, {_FIX}, and its Python "
            "source is not available to run instead (loaded with torch.jit.load?). Call the Python "
            "function it was scripted from, or run the model under the graph_partition strategy."
        )
    return python(*args, **kwargs)


def _method_call(self, *args, **kwargs):
    rows = _rows_argument(args, kwargs)
    if rows is None:
        return _ORIGINAL_METHOD_CALL(self, *args, **kwargs)
    try:
        owner = self.owner._type().name()
    except (AttributeError, RuntimeError):
        owner = "a scripted module"
    raise NoRuleError(
        f"TorchScript method `{owner}.{self.name}` called on {describe(placement_of(rows))}: a module made "
        f"with torch.jit.script runs in the TorchScript interpreter, outside mlipdd's dispatch, {_FIX}. "
        "Use the module unscripted (keep torch.jit.script for deployment), or run the model under the "
        "graph_partition strategy."
    )


@contextlib.contextmanager
def script_functions_dispatched() -> Iterator[None]:
    """Inside: a script function called with a ShardTensor runs its Python source under the
    dispatch (NOTE [scripted functions]); nested and concurrent scopes share one patch."""
    global _DEPTH
    with _LOCK:
        _DEPTH += 1
        if _DEPTH == 1:
            _SCRIPT_FUNCTION.__call__ = _call
            _SCRIPT_METHOD.__call__ = _method_call
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                _SCRIPT_FUNCTION.__call__ = _ORIGINAL_CALL
                _SCRIPT_METHOD.__call__ = _ORIGINAL_METHOD_CALL
