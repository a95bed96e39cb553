"""cuEquivariance MACE: conversion with mace's own converter, and its kernels under DD.

mace converts an e3nn model with ``mace.cli.convert_e3nn_cueq.run``: linears, the
channel-wise (convolution) tensor product, the skip tensor product and the symmetric
contraction become cuequivariance-torch layers. Each of those evaluates a
``cuet.SegmentedPolynomial``: with cuequivariance-ops-torch on a GPU through the CUDA
op ``cuequivariance::uniform_1d``, without it through cuequivariance's own torch code
(``method="naive"``, which also runs on CPU, float32 and float64).

# NOTE [cuEq under domain decomposition]
The dispatch cannot see inside ``uniform_1d``: it refuses an opaque op on atom or edge
rows. Every polynomial call mace makes is one of two kinds, told apart by its indices:

* row-local: each output row is a function of the same row of every row input (a
  channel-wise product per edge, a linear or a symmetric contraction per atom; an
  index, if any, picks a row of a weight table for each row: the element of an atom).
  It runs on this rank's rows as they are, and the result keeps their placement.
* fused convolution (``conv_fusion``, mace's default on CUDA): an input index of edge
  rows whose values are atom rows (the senders) reads node features, and an output
  index (the receivers) sums the messages into node rows. It runs on this rank's
  sender table (halo storage: ``[owned | ghost]`` rows, ghost rows current; sharded
  storage: owned rows plus the remote senders fetched in one routed read, as the
  chunked path does) and gives the partial sums on the receivers' rows; one
  ``index_add`` into node rows then completes them like the plain model's scatter
  (NOTE [one scatter per layer] in `mlipdd_mace.chunked`). Chunked (``chunk_atoms``), the
  chunks call the kernel on plain rows of the same sender table and this rule does not
  fire; the chunked path issues the same table read and scatter once per layer (NOTE
  [chunked fused convolution under DD] in `mlipdd_mace.chunked`).

Any other call (an index the rules above do not name) is refused with the fix. The
kernels stay mace's and cuequivariance's; `distributed_kernels` only decides which
rows they get, and only while a distributed forward runs (`MACEWrapper.forward`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings

import torch

from mlipdd.shard import FIRED, NoRuleError, ShardTensor, local, placement_of

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


# ---- the kernels under domain decomposition ------------------------------------------------


def _rows_of(t) -> object | None:
    """The row placement of a distributed tensor (None: a plain or replicated tensor)."""
    return placement_of(t) if isinstance(t, ShardTensor) else None


def _refuse(why: str) -> NoRuleError:
    return NoRuleError(
        f"a cuEquivariance tensor product under domain decomposition {why}; mlipdd knows mace's "
        "row-local products and its fused convolution (NOTE [cuEq under domain decomposition] in "
        "mlipdd_mace.cueq). Convert with conv_fusion=False (MACEWrapper.from_file(path, cueq=True, "
        "conv_fusion=False)) or run the e3nn model"
    )


def _sender_table(nodes: torch.Tensor) -> torch.Tensor:
    """Every node row this rank's edges read, in the rows its local sender indices count:
    halo storage ``[owned | ghost]`` (ghost rows made current), sharded storage
    ``[owned | request table]`` fetched from the owners in one routed read."""
    meta = nodes.meta
    if meta.layout.is_sharded():
        return nodes.index_select(0, torch.arange(meta.plan.n_padded, device=local(nodes).device))
    if placement_of(nodes).stale:
        from mlipdd.shard import refresh_ghosts

        return refresh_ghosts(nodes)
    return nodes


def _row_local(original, inputs, input_indices, output_shapes, output_indices, rows):
    """A call in which every output row comes from the same rows of the inputs."""
    FIRED["mace_cueq:row_local"] += 1
    place = dataclasses.replace(rows[0], values=None, stale=any(p.stale for p in rows))
    meta = next(t.meta for t in (*inputs, *input_indices.values()) if _rows_of(t) is not None)
    outs = original([local(t) for t in inputs], {k: local(v) for k, v in input_indices.items()},
                    {k: local(v) for k, v in output_shapes.items()}, {})
    return [ShardTensor.wrap(o, meta, place) for o in outs]


def _fused_convolution(original, inputs, input_indices, output_shapes, output_indices):
    """Gather from the sender table, product, and receiver sums in the fused kernel on this
    rank's rows, then one scatter into node rows completes the sums across ranks."""
    FIRED["mace_cueq:fused_conv"] += 1
    tables = {k: _sender_table(inputs[k]) for k, idx in input_indices.items() if _is_sender_index(inputs[k], idx)}
    plain = [local(tables.get(k, t)) for k, t in enumerate(inputs)]
    if all(local(v).shape[0] == 0 for v in output_indices.values()):
        # a rank without edges (a slab's vacuum) sums nothing, but still joins the scatter's
        # exchange below, in the forward and (zeros tied to the inputs) in the backward;
        # cuEq's reference kernels mistake an empty receiver list for none
        module = original.__self__
        like = plain[next(iter(input_indices))]
        tie = sum(t.sum() for t in plain if t.requires_grad) * 0
        outs = [like.new_zeros((local(output_shapes[k]).shape[0], operand.size)) + tie
                for k, operand in enumerate(module._polynomial_orig.outputs)]
    else:
        outs = original(plain, {k: local(v) for k, v in input_indices.items()},
                        {k: local(v) for k, v in output_shapes.items()},
                        {k: local(v) for k, v in output_indices.items()})
    done = []
    for k, out in enumerate(outs):
        target = output_shapes.get(k)
        if k not in output_indices or not isinstance(target, ShardTensor):
            raise _refuse(f"returns output {k} without receiver rows")
        # NOTE [one scatter per layer] (chunked.py): the kernel summed this rank's edges on
        # plain rows; this scatter into node rows is the plain model's, so the dispatch
        # completes ghost partials (halo) and keeps owned rows (sharded) exactly there.
        rows = torch.arange(out.shape[0], device=out.device)
        done.append(target.new_zeros(out.shape).index_add(0, rows, out))
    return done


def _is_sender_index(table, index) -> bool:
    place, table_place = _rows_of(index), _rows_of(table)
    return (place is not None and place.kind == "edges" and place.values == "atoms"
            and table_place is not None and table_place.kind == "atoms")


def distributed_polynomial(original, inputs, input_indices=None, output_shapes=None, output_indices=None):
    """``SegmentedPolynomial.forward`` for distributed rows (NOTE [cuEq under domain
    decomposition]); plain tensors go to ``original`` untouched."""
    inputs = list(inputs)
    input_indices, output_shapes, output_indices = input_indices or {}, output_shapes or {}, output_indices or {}
    everything = (*inputs, *input_indices.values(), *output_shapes.values(), *output_indices.values())
    if not any(_rows_of(t) is not None for t in everything):
        return original(inputs, input_indices, output_shapes, output_indices)
    if output_indices:
        for k, idx in input_indices.items():
            if not _is_sender_index(inputs[k], idx):
                raise _refuse(f"indexes input {k} with a tensor that is not an edge list's senders")
        for k, idx in output_indices.items():
            place = _rows_of(idx)
            if place is None or place.kind != "edges" or place.values != "atoms" or _rows_of(output_shapes.get(k)) is None:
                raise _refuse(f"scatters output {k} by a tensor that is not an edge list's receivers")
        return _fused_convolution(original, inputs, input_indices, output_shapes, output_indices)
    rows = [p for p in (_rows_of(t) for t in (*inputs, *input_indices.values())) if p is not None]
    indexed_rows = [k for k in input_indices if _rows_of(inputs[k]) is not None]
    if indexed_rows:
        raise _refuse(f"gathers rows of input(s) {indexed_rows} without summing into receivers")
    kinds = {(p.kind, p.dim, p.group) for p in rows}
    if len(kinds) != 1 or not rows[0].leads():
        raise _refuse(f"mixes rows of different kinds ({sorted(kinds)})")
    return _row_local(original, inputs, input_indices, output_shapes, output_indices, rows)


def _row_local_transpose(original, x):
    """cuEq's layout transpose reorders each row's features; a CUDA op on a GPU."""
    place = _rows_of(x)
    if place is None:
        return original(x)
    FIRED["mace_cueq:transpose"] += 1
    return ShardTensor.wrap(original(local(x)), x.meta, place)


@contextlib.contextmanager
def distributed_kernels(model: torch.nn.Module):
    """While active, the model's cuEq polynomials and transposes take distributed rows.

    Patched per instance: mace's fused convolution keeps the polynomial's bound forward as
    ``original_forward`` (its own ``forward`` feeds it the indices), so that one is
    wrapped; every other polynomial's ``forward``.
    """
    from cuequivariance_torch.primitives.transpose import TransposeSegments

    patched = []  # (module, attribute, previous instance value or None)
    try:
        for m in _polynomials(model):
            attribute = "original_forward" if "original_forward" in vars(m) else "forward"
            previous = vars(m).get(attribute)
            inner = previous if previous is not None else type(m).forward.__get__(m)
            setattr(m, attribute, functools.partial(distributed_polynomial, inner))
            patched.append((m, attribute, previous))
        for m in model.modules():
            if isinstance(m, TransposeSegments):
                previous = vars(m).get("forward")
                inner = previous if previous is not None else type(m).forward.__get__(m)
                m.forward = functools.partial(_row_local_transpose, inner)
                patched.append((m, "forward", previous))
        yield
    finally:
        for m, attribute, previous in reversed(patched):
            if previous is None:
                delattr(m, attribute)
            else:
                setattr(m, attribute, previous)
