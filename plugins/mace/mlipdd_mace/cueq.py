"""cuEquivariance MACE: conversion with mace's own converter, and its kernels under DD.

mace converts an e3nn model with ``mace.cli.convert_e3nn_cueq.run``: linears, the
channel-wise (convolution) tensor product, the skip tensor product and the symmetric
contraction become cuequivariance-torch layers. Each of those evaluates a
``cuet.SegmentedPolynomial``: with cuequivariance-ops-torch on a GPU through the CUDA
op ``cuequivariance::uniform_1d``, without it through cuequivariance's own torch code
(``method="naive"``, which also runs on CPU, float32 and float64).

Under domain decomposition the aten dispatch runs the converted model (its polynomials
reach it as their aten ops: tests/test_cueq_aten.py); nothing here is distributed.
`FIRED` counts the chunked fused convolution's calls (`mlipdd_mace.chunked_fused`).
"""

from __future__ import annotations

import collections
import warnings

import torch

FIRED: collections.Counter = collections.Counter()  # calls of the chunked fused convolution, for the tests

INSTALL_HINT = (
    "pip install 'mlipdd[cueq]' (CUDA 12 kernels), 'mlipdd[cueq-cu13]' (CUDA 13) or "
    "'mlipdd[cueq-cpu]' (cuequivariance's torch reference code only)"
)


def require_cuequivariance() -> str:
    """cuequivariance-torch's version; ImportError with the install line when missing."""
    try:
        import cuequivariance_torch
    except ImportError as exc:
        raise ImportError(
            f"cuEquivariance MACE (cueq=True) needs cuequivariance-torch, which is not installed "
            f"({exc}); {INSTALL_HINT}"
        ) from exc
    return cuequivariance_torch.__version__


def cuda_kernels_available() -> bool:
    """Whether cuequivariance-ops-torch (the CUDA kernels) imports."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import cuequivariance_ops_torch  # noqa: F401
        except (ImportError, OSError, RuntimeError):
            return False
    return True


def uses_cuequivariance(model: torch.nn.Module) -> bool:
    """Whether mace's e3nn->cuEquivariance conversion replaced some of the model's layers."""
    return any(type(m).__module__.startswith("cuequivariance") for m in model.modules())


def fused_convolutions(model: torch.nn.Module) -> bool:
    """Whether the interaction blocks use cuEq's fused convolution (gather, product, scatter
    in one kernel), which mace's converter picks on CUDA."""
    return any(hasattr(block, "conv_fusion") for block in getattr(model, "interactions", ()))


def _polynomials(model: torch.nn.Module) -> list:
    from cuequivariance_torch import SegmentedPolynomial

    return [m for m in model.modules() if isinstance(m, SegmentedPolynomial)]


def tensor_product_path(model: torch.nn.Module) -> str:
    """Which tensor products the model runs: ``"e3nn"``, or cuEquivariance with its conv
    form and kernels, e.g. ``"cuequivariance (fused conv, CUDA kernels)"``."""
    if not uses_cuequivariance(model):
        return "e3nn"
    methods = {m.method for m in _polynomials(model)}
    kernels = "CUDA kernels" if methods - {"naive"} else "torch reference kernels"
    conv = "fused conv" if fused_convolutions(model) else "unfused conv"
    return f"cuequivariance ({conv}, {kernels})"


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def to_cueq(model: torch.nn.Module, conv_fusion: bool | None = None) -> torch.nn.Module:
    """``model`` (a raw e3nn mace model) converted by mace's ``convert_e3nn_cueq``, on the
    model's device, in eval mode; a model already converted is returned as is.

    ``conv_fusion``: fuse each convolution's gather, tensor product and scatter into one
    CUDA kernel (None: on CUDA, as mace's converter does). It needs the CUDA kernels; the
    unfused form leaves the gather and scatter to torch and the products to cuEq.
    """
    if uses_cuequivariance(model):
        return model
    require_cuequivariance()
    device = _device_of(model)
    kernels = cuda_kernels_available()
    if device.type == "cuda" and not kernels:
        raise ImportError(
            "cuEquivariance MACE on a GPU needs cuequivariance's CUDA kernels "
            f"(cuequivariance-ops-torch-cu12 or -cu13), which do not import here; {INSTALL_HINT}. "
            "Without them cuequivariance falls back to its torch reference code, slower than e3nn"
        )
    if conv_fusion is None:
        conv_fusion = device.type == "cuda"
    if conv_fusion and device.type != "cuda":
        raise ValueError(
            f"conv_fusion=True needs the model on a CUDA device (it is on {device}): the fused "
            "convolution exists only as a CUDA kernel. Move the model to the GPU first, or pass "
            "conv_fusion=False"
        )
    from mace.cli.convert_e3nn_cueq import run as convert_e3nn_cueq

    previous = torch.get_default_dtype()  # the converter sets the default dtype to the model's
    try:
        with warnings.catch_warnings():
            # without the CUDA kernels every layer says it falls back to the torch code;
            # tensor_product_path reports that once
            warnings.filterwarnings("ignore", message=".*Falling back to naive.*")
            # mace's converter fuses the convolutions exactly when its device is "cuda"
            converted = convert_e3nn_cueq(model, device="cuda" if conv_fusion else "cpu")
    finally:
        torch.set_default_dtype(previous)
    return converted.to(device).eval()
