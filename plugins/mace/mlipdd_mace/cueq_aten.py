"""cuEquivariance's kernels under the aten dispatch (NOTE [cuEq kernels under aten]).

# NOTE [cuEq kernels under aten]
On a GPU every cuEq layer of mace calls the CUDA op ``cuequivariance::uniform_1d``, which reads
raw buffers: the aten dispatch refuses it on rows. On the CPU the same layers run cuEq's torch
code, whose aten ops the rules see. So while a distributed forward runs, each polynomial's
forward (and each layout transpose) is one adapted call (`mlipdd.shard.call_adapted`, NOTE
[aten op adapters]) whatever its method: the kernel runs on this rank's plain rows, as one
autograd node.

* A call with output indices is mace's fused convolution: it gathers node rows by the
  senders and sums the products into the receivers' rows. The node rows it reads are every
  row the edge index names (halo: ghosts made current; sharded: the request table fetched,
  NOTE [adapted reads under sharded storage]), and its outputs are this rank's SHARES of
  the receivers' sums (``ScatterOutputs``), completed like the plain model's scatter.
* Any other call is row-local (a linear or a symmetric contraction per atom, a channel-wise
  product per edge, an element index picking a weight row per atom): its output rows are
  the input rows' placement, as the adapter reads them.

A rank without edges (a slab's vacuum) still makes the fused call, with zero rows of
messages: cuEq's kernels take an empty receiver list for none, so that call is answered with
zeros of the output's shape, tied to the inputs.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from mlipdd.shard import call_adapted
from mlipdd.spec import OpAdapter, ScatterOutputs

ROW_LOCAL = OpAdapter("mlipdd_mace::cueq_row_local")


@functools.cache
def _fused(n_outputs: int) -> OpAdapter:
    return OpAdapter("mlipdd_mace::cueq_fused_convolution",
                     output_transforms={k: ScatterOutputs() for k in range(n_outputs)})


def adapted_polynomial(polynomial, original, inputs, input_indices=None, output_shapes=None, output_indices=None):
    """``polynomial``'s forward ``original`` as one adapted call (NOTE [cuEq kernels under aten])."""
    inputs = list(inputs)
    dicts = [d or {} for d in (input_indices, output_shapes, output_indices)]
    keys = [sorted(d) for d in dicts]
    flat = [*inputs, *(d[k] for d, ks in zip(dicts, keys) for k in ks)]

    def run(*tensors):
        at = iter(tensors[len(inputs):])
        ins = list(tensors[: len(inputs)])
        indices, shapes, out_indices = ({k: next(at) for k in ks} for ks in keys)
        if out_indices and all(v.shape[0] == 0 for v in out_indices.values()):  # no edges here
            tie = sum(t.sum() for t in ins if t.requires_grad) * 0
            like = ins[0]
            return tuple(like.new_zeros((shapes[k].shape[0], operand.size)) + tie
                         for k, operand in enumerate(polynomial._polynomial_orig.outputs))
        return tuple(original(ins, indices, shapes, out_indices))

    adapter = _fused(len(polynomial._polynomial_orig.outputs)) if dicts[2] else ROW_LOCAL
    out = call_adapted(adapter, run, *flat)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _adapted_transpose(_, original, x):
    return call_adapted(ROW_LOCAL, original, x)


@contextlib.contextmanager
def aten_kernels(model: torch.nn.Module):
    """While active, the model's cuEq polynomials and transposes are adapted calls.

    Patched per instance: mace's fused convolution keeps the polynomial's bound forward as
    ``original_forward`` (its own ``forward`` feeds it the indices), so that one is wrapped;
    every other polynomial's ``forward``."""
    from cuequivariance_torch import SegmentedPolynomial
    from cuequivariance_torch.primitives.transpose import TransposeSegments

    patched = []  # (module, attribute, previous instance value or None)
    try:
        for m in model.modules():
            if isinstance(m, SegmentedPolynomial):
                attribute, wrap = ("original_forward" if "original_forward" in vars(m) else "forward"), adapted_polynomial
            elif isinstance(m, TransposeSegments):
                attribute, wrap = "forward", _adapted_transpose
            else:
                continue
            previous = vars(m).get(attribute)
            inner = previous if previous is not None else type(m).forward.__get__(m)
            setattr(m, attribute, functools.partial(wrap, m, inner))
            patched.append((m, attribute, previous))
        yield
    finally:
        for m, attribute, previous in reversed(patched):
            if previous is None:
                delattr(m, attribute)
            else:
                setattr(m, attribute, previous)
