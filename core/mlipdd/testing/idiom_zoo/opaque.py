"""Scatters hidden from Python-level dispatch: TorchScript, autograd.Function, a custom op.

schnetpack and matgl script their scatter helpers; some models script whole blocks;
fused kernels come as an ``autograd.Function`` with a hand-written backward or as a
``torch.library`` custom op. Each model below does the plain SchNet-like aggregation
of layer 0 through one of these, then a plain second layer.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mlipdd.testing.idiom_zoo._base import ZooModel


@torch.jit.script
def scripted_scatter_sum(src: Tensor, index: Tensor, dim_size: int) -> Tensor:
    out = torch.zeros([dim_size, src.shape[1]], dtype=src.dtype, device=src.device)
    return out.index_add(0, index, src)


class _Interaction(nn.Module):
    def __init__(self, radial: Tensor, update: Tensor):
        super().__init__()
        self.radial = nn.Parameter(radial)
        self.update = nn.Parameter(update)

    def forward(self, h: Tensor, rbf: Tensor, sender: Tensor, receiver: Tensor) -> Tensor:
        messages = (rbf @ self.radial) * h.index_select(0, sender)
        aggregated = torch.zeros_like(h).index_add(0, receiver, messages)
        return h + torch.tanh(aggregated @ self.update)


class ScatterSum(torch.autograd.Function):
    """Sum of ``src`` rows into ``dim_size`` rows, with its adjoint (a gather) by hand."""

    @staticmethod
    def forward(ctx, src, index, dim_size):
        ctx.save_for_backward(index)
        return src.new_zeros(dim_size, src.shape[1]).index_add(0, index, src)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


@torch.library.custom_op("mlipdd_idiom_zoo::scatter_sum", mutates_args=())
def library_scatter_sum(src: Tensor, index: Tensor, dim_size: int) -> Tensor:
    return src.new_zeros(dim_size, src.shape[1]).index_add(0, index, src)


@library_scatter_sum.register_fake
def _(src, index, dim_size):
    return src.new_empty(dim_size, src.shape[1])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return grad.index_select(0, index), None, None


library_scatter_sum.register_autograd(_backward, setup_context=_setup)


class _OpaqueFirstLayer(ZooModel):
    def scatter(self, messages, receiver, n_atoms):
        raise NotImplementedError

    def first_layer(self, h, e):
        messages = (e.rbf @ self.filters[0]) * h[e.sender]
        return h + torch.tanh(self.scatter(messages, e.receiver, h.shape[0]) @ self.updates[0])

    def atomic_energies(self, batch, positions, cell):
        e = self.edges(batch, positions, cell)
        h = self.first_layer(self.embed[batch.atomic_numbers], e)
        return self.energy(self.interaction(1, h, e))


class JitScriptHelper(_OpaqueFirstLayer):
    idiom = "@torch.jit.script scatter helper (schnetpack/matgl style)"

    def scatter(self, messages, receiver, n_atoms):
        return scripted_scatter_sum(messages, receiver, n_atoms)


class JitScriptedBlock(_OpaqueFirstLayer):
    idiom = "torch.jit.script(Interaction(...)) submodule"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = torch.jit.script(_Interaction(self.filters[0].detach().clone(), self.updates[0].detach().clone()))

    def first_layer(self, h, e):
        return self.block(h, e.rbf, e.sender, e.receiver)


class AutogradFunctionScatter(_OpaqueFirstLayer):
    idiom = "autograd.Function scatter with a hand-written backward"

    def scatter(self, messages, receiver, n_atoms):
        return ScatterSum.apply(messages, receiver, n_atoms)


class LibraryCustomOp(_OpaqueFirstLayer):
    idiom = "torch.library.custom_op scatter (no OpAdapter)"

    def scatter(self, messages, receiver, n_atoms):
        return library_scatter_sum(messages, receiver, n_atoms)


OPAQUE = [JitScriptHelper, JitScriptedBlock, AutogradFunctionScatter, LibraryCustomOp]
