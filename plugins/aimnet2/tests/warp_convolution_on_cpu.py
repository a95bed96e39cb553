"""aimnet's CUDA-only convolution path, run on the CPU with the real Warp kernel.

On CUDA in float32, aimnet's `ConvSV.forward` (flat layout, 2-D features) does not take
its torch einsum: it calls the Warp kernel `aimnet.kernels.conv_sv_2d_sp`, whose defaults
follow aimnet's padded layout (the last atom row is the padding atom: never a centre, and
any index >= it is a sentinel that ends a row's scan). A CPU-only machine never runs that
branch, so a layout that breaks the contract passes every CPU test and is silently wrong
on the GPU. Warp compiles the same kernel for the CPU: `cuda_convolution_on_cpu()` takes
the CUDA branch on CPU tensors (aimnet's defaults unchanged; only the device checks go),
so tests and `.old/gpu/aimnet2_cuda_diag.py` can exercise it here.
"""

from __future__ import annotations

import contextlib

import torch

_REGISTERED = False


def _register_cpu_kernels() -> None:
    """aimnet registers its Warp ops for CUDA only; the same implementations run on Warp's CPU device."""
    global _REGISTERED
    if _REGISTERED:
        return
    from aimnet.kernels import conv_sv_2d_sp_wp as kernels

    torch.library.register_kernel("aimnet::conv_sv_2d_sp_fwd", "cpu", kernels._conv_sv_2d_sp_fwd_impl)
    torch.library.register_kernel(
        "aimnet::conv_sv_2d_sp_bwd", "cpu",
        lambda grad, a, idx, g, padding_value, num_centers: kernels._conv_sv_2d_sp_bwd_impl(
            grad, a, idx, g, padding_value, num_centers))
    _REGISTERED = True


def _conv_sv_2d_sp_any_device(a, idx, g, padding_value=None, num_centers=None, transpose=None):
    """`aimnet.kernels.conv_sv_2d_sp` without its CUDA check: the same defaults (padding row = last row)."""
    if padding_value is None:
        padding_value, num_centers = a.shape[0] - 1, idx.shape[0] - 1
    return torch.ops.aimnet.conv_sv_2d_sp_fwd(a.contiguous(), idx.to(torch.int32).contiguous(), g.contiguous(),
                                              padding_value, num_centers)


@contextlib.contextmanager
def cuda_convolution_on_cpu():
    """Inside: `ConvSV.forward` takes its CUDA float32 branch (Warp kernel) on any device."""
    from aimnet import nbops
    from aimnet.modules import aev

    _register_cpu_kernels()
    original_forward, original_kernel = aev.ConvSV.forward, aev.conv_sv_2d_sp

    def forward(self, data, a):
        g_sv = data["g_sv"]
        mode = nbops.get_nb_mode(data)
        if mode == 1 and self.d2features and a.dtype == torch.float32 and g_sv.dtype == torch.float32:
            # the module-level name, looked up at call time as aimnet's own branch does
            avf_sv = aev.conv_sv_2d_sp(a, data["nbmat"], g_sv, transpose=aev._nbmat_transpose(data))
            return self._finish_convolution(data, avf_sv, mode)
        return original_forward(self, data, a)

    aev.ConvSV.forward, aev.conv_sv_2d_sp = forward, _conv_sv_2d_sp_any_device
    try:
        yield
    finally:
        aev.ConvSV.forward, aev.conv_sv_2d_sp = original_forward, original_kernel
