"""cuEquivariance's fused convolution, chunked (`mlipdd_mace.chunked` is the whole story).

The fused convolution (``conv_fusion``: gather, product and receiver sums in one kernel,
mace's default on CUDA) keeps no message per edge but does keep each edge's radial weights
for its backward (~1.3k floats per edge and layer for medium MACE: ~440 GiB at 1M atoms).
`FusedEdgeChunkedMessages` calls the same kernel on ``chunk`` edges at a time, handing it
only the node-table rows those edges read and sum into (`_row_spans`).

Its backward recomputes each chunk's radial weights (the one thing too large to keep) and
then calls the convolution's vector-Jacobian product directly: cuequivariance derives that
polynomial from the forward one (``SegmentedPolynomial.backward``), and the same kernels
run it. Recomputing the chunk's forward through autograd instead would run the fused kernel
once more per chunk only to throw its sums away (`RECOMPUTE_CONVOLUTION`).

Traffic per layer, for the record (medium MACE float32: E edges, W = 1280 radial weights
per edge in layer 2, 512 in layer 1, the largest per-edge tensor), in units of E*W floats
(~330 GB for both layers at 1M atoms): a plain fused model moves ~5 (the MLP writes the
weights, the kernel reads them, its backward reads them and writes their gradient, the MLP's
backward reads that); the first chunked version ~7 (the MLP and the kernel forward again in
the backward); now ~6. Counted on the CPU by benchmarks/mace_cueq_chunk_cost.py: 1.16x and
1.00x the plain model's bytes per atom. A model built with ``apply_cutoff=False`` (the cutoff
reaches the interaction) also skips the weights-sized cutoff product and its backward, ~8
more units (`mlipdd_mace.chunked.radial_weights`); mace's default scales the radial features.
"""

from __future__ import annotations

import math
import weakref

import torch

from mlipdd.models import capturing

# A/B switch for benchmarks (.old/gpu/cueq_chunk_fused.py): True recomputes each chunk's
# kernel forward in the backward and differentiates it with autograd, the first version.
RECOMPUTE_CONVOLUTION = False


def _row_spans(edge_index: torch.Tensor, chunk: int, n_rows: int, separate: bool) -> list[tuple[int, int, int, int]]:
    """Per chunk of ``chunk`` edges, the node-table rows ``(read_lo, read_hi, sum_lo, sum_hi)``
    its senders read and its receivers sum into (``separate=False``: one span for both).

    The fused kernel reads senders from and sums into a node table; handing it only the
    rows a chunk touches keeps each call's output (and its backward's sender gradient) at
    the chunk's size instead of the whole system's. Receivers come sorted (mlipdd's
    neighbour lists), so a chunk sums into ~``chunk_atoms`` rows; its senders' span is
    narrow for spatially ordered atoms and wide for a chunk whose neighbours wrap around a
    periodic cell. Any order stays exact (a span is then wider, up to all rows). One host
    read for all chunks; `spans_of` shares it between layers.
    """
    n = edge_index.shape[1]
    if capturing(edge_index):
        # a CUDA-graph capture or a compile trace refuses the host read: every chunk gets
        # the whole table (exact; each call's output is then the system's size)
        return [(0, n_rows, 0, n_rows)] * math.ceil(n / chunk)
    full = n - n % chunk
    parts = []  # [lo_sender, hi_sender, lo_receiver, hi_receiver] per chunk
    if full:
        blocks = edge_index[:, :full].reshape(2, -1, chunk)
        parts.append(torch.cat([blocks.amin(dim=2), blocks.amax(dim=2)]))
    if full < n:
        tail = edge_index[:, full:]
        parts.append(torch.cat([tail.amin(dim=1), tail.amax(dim=1)]).reshape(4, 1))
    if not parts:
        return []
    spans = []
    for s_lo, r_lo, s_hi, r_hi in torch.cat(parts, 1).t().tolist():
        if not separate:
            s_lo = r_lo = min(s_lo, r_lo)
            s_hi = r_hi = max(s_hi, r_hi)
        spans.append((s_lo, s_hi + 1, r_lo, r_hi + 1))
    return spans


def spans_of(cache: dict, edge_index: torch.Tensor, chunk: int, n_rows: int, separate: bool) -> list:
    """`_row_spans`, read once per forward: every layer chunks the same edge list over the
    same table, so the layers after the first reuse the first one's host read. ``cache``
    lives for one forward (`mlipdd_mace.chunked.chunked_blocks`)."""
    key = (edge_index.data_ptr(), tuple(edge_index.shape), chunk, n_rows, separate)
    if key not in cache:
        cache[key] = _row_spans(edge_index, chunk, n_rows, separate)
    return cache[key]


def _polynomial_module(conv_tp):
    """The cuEq `SegmentedPolynomial` behind a fused convolution, or None: mace's fused block
    is one (keeping its call with separate sender and receiver tables as ``original_forward``;
    its ``forward`` only unpacks ``edge_index``), the CPU stand-in
    `mlipdd_mace.testing.ReferenceFusedConvolution` holds one as ``polynomial``. Any other
    fused form is called through its public forward on one joint span."""
    try:
        from cuequivariance_torch import SegmentedPolynomial
    except ImportError:
        return None
    if isinstance(conv_tp, SegmentedPolynomial) and "original_forward" in vars(conv_tp):
        return conv_tp
    inner = getattr(conv_tp, "polynomial", None)
    return inner if isinstance(inner, SegmentedPolynomial) else None


def _polynomial_call(conv_tp):
    """The polynomial's call ``(inputs, input_indices, output_shapes, output_indices)``, or None."""
    module = _polynomial_module(conv_tp)
    if module is None:
        return None
    return module.original_forward if "original_forward" in vars(module) else module


_VJPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # polynomial module -> {key: VJP module}


def _vjp(module, need: tuple[bool, bool, bool], device) -> torch.nn.Module:
    """cuEq's vector-Jacobian product of the convolution polynomial for the inputs
    ``need`` marks (weights, sender table, harmonics): a polynomial of (weights, senders,
    harmonics, cotangent of the sums) giving those gradients, run by the forward's method
    (its CUDA kernels on a GPU). Built once per module, pattern and device, kept outside the
    module (its state dict stays as it was), and from the forward: cuEq's reference code
    builds by fx tracing, which needs torch-function dispatch, and a backward under domain
    decomposition may run inside a ShardTensor exchange's handler, where that is off."""
    from cuequivariance_torch import SegmentedPolynomial

    per_module = _VJPS.setdefault(module, {})
    key = (need, str(device))
    if key not in per_module:
        polynomial, _ = module._polynomial_orig.backward(list(need), [True])
        # cuEq's reference code builds its einsums by fx tracing, which opt_einsum's path
        # search cannot take (it asks a traced shape for its len); the traced einsum runs
        # with whatever opt_einsum setting holds when called
        with torch.backends.opt_einsum.flags(enabled=False):
            per_module[key] = SegmentedPolynomial(polynomial, method=module.method,
                                                  math_dtype=module._math_dtype_orig).to(device)
    return per_module[key]


def _fused_chunk(block, call, read, sums_like, edge_attrs, edge_feats, cutoff, sender, receiver):
    """mace's fused convolution (gather, product, receiver sums in one call) on one chunk of
    edges: senders index ``read``, receivers ``sums_like``'s rows (both slices of the node
    table); the sums on those rows."""
    from mlipdd_mace.chunked import radial_weights

    weights = radial_weights(block, edge_feats, cutoff)
    if call is None:  # one joint span: read and sums_like are the same rows
        return block.conv_tp(read, edge_attrs, weights, torch.stack([sender, receiver]))
    return call([weights, read, edge_attrs], {1: sender}, {0: sums_like}, {0: receiver})[0]


def _chunks(chunk, spans, edge_index):
    """(start, end, read_lo, read_hi, sum_lo, sum_hi, local senders, local receivers) per chunk."""
    for start, (s_lo, s_hi, r_lo, r_hi) in zip(range(0, edge_index.shape[1], chunk), spans):
        end = start + chunk
        yield start, end, s_lo, s_hi, r_lo, r_hi, edge_index[0, start:end] - s_lo, edge_index[1, start:end] - r_lo


def _wanted(needs_input_grad, has_cutoff: bool) -> tuple[bool, bool, bool, bool]:
    """Which of (sender table, harmonics, radial features, cutoff) want a gradient."""
    want = needs_input_grad
    return want[3], want[4], want[5], has_cutoff and want[6]


def _vjp_need(want) -> tuple[bool, bool, bool]:
    """The convolution inputs (weights, sender table, harmonics) whose gradients ``want`` needs."""
    want_read, want_attrs, want_feats, want_cut = want
    return want_feats or want_cut, want_read, want_attrs


def _vjp_chunk(block, vjp, cot, read, edge_attrs, edge_feats, cutoff, sender, receiver, want):
    """Gradients of one chunk's sums (cotangent ``cot`` on its receiver rows) for the sender
    rows ``read``, the harmonics, the radial features and the cutoff (None where ``want``
    says no), from the recomputed radial weights and the convolution's VJP polynomial."""
    from mlipdd_mace.chunked import radial_weights

    want_read, _, want_feats, want_cut = want
    with torch.enable_grad():
        f = edge_feats.detach().requires_grad_(want_feats)
        c = cutoff.detach().requires_grad_(want_cut) if cutoff is not None else None
        weights = radial_weights(block, f, c)
    need = _vjp_need(want)
    # the VJP's outputs are the needed inputs' gradients, in input order; the sender
    # table's gradient sums into the rows of ``read`` (an indexed output), the others are per edge
    wanted = [k for k in range(3) if need[k]]
    likes = (weights, read, edge_attrs)
    out_shapes = {i: likes[k] for i, k in enumerate(wanted)}
    out_index = {wanted.index(1): sender} if want_read else {}
    grads = iter(vjp(
        [weights.detach(), read, edge_attrs, cot], {1: sender, 3: receiver}, out_shapes, out_index))
    grad_weights, grad_read, grad_attrs = (next(grads) if needed else None for needed in need)
    grad_f = grad_c = None
    if grad_weights is not None:
        inputs = [t for t in (f, c) if t is not None and t.requires_grad]
        back = iter(torch.autograd.grad(weights, inputs, grad_weights))
        grad_f = next(back) if want_feats else None
        grad_c = next(back) if want_cut else None
    return grad_read, grad_attrs, grad_f, grad_c


def _recomputed_chunk(block, call, table, s_lo, s_hi, r_lo, r_hi, grad, edge_attrs, edge_feats, cutoff,
                      sender, receiver, want):
    """The same gradients by running the chunk's forward again and differentiating it
    (any fused form without a cuEq polynomial, and `RECOMPUTE_CONVOLUTION`)."""
    want_read, want_attrs, want_feats, want_cut = want
    with torch.enable_grad():
        x = table[s_lo:s_hi].detach().requires_grad_(want_read)
        a = edge_attrs.detach().requires_grad_(want_attrs)
        f = edge_feats.detach().requires_grad_(want_feats)
        c = cutoff.detach().requires_grad_(want_cut) if cutoff is not None else None
        sums = _fused_chunk(block, call, x, table[r_lo:r_hi], a, f, c, sender, receiver)
        inputs = [t for t in (x, a, f, c) if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(sums, inputs, grad[r_lo:r_hi].contiguous()) if inputs else ())
    return tuple(next(grads) if t is not None and t.requires_grad else None for t in (x, a, f, c))


class FusedEdgeChunkedMessages(torch.autograd.Function):
    """The fused convolution's receiver sums over the node table, ``chunk`` edges per kernel
    call on the rows each chunk touches (`_row_spans`); the backward recomputes each chunk's
    radial weights (they are never kept) and applies the convolution's VJP (module docstring)."""

    @staticmethod
    def forward(ctx, block, chunk, spans, table, edge_attrs, edge_feats, cutoff, edge_index, width):
        call = _polynomial_call(block.conv_tp)
        ctx.block, ctx.chunk, ctx.call, ctx.spans, ctx.has_cutoff = block, chunk, call, spans, cutoff is not None
        ctx.save_for_backward(table, edge_attrs, edge_feats, cutoff, edge_index)
        ctx.want = _wanted(ctx.needs_input_grad, cutoff is not None)
        module = None if RECOMPUTE_CONVOLUTION else _polynomial_module(block.conv_tp)
        ctx.vjp = _vjp(module, _vjp_need(ctx.want), table.device) if module is not None and any(ctx.want) else None
        out = table.new_zeros((table.shape[0], width))
        for start, end, s_lo, s_hi, r_lo, r_hi, sender, receiver in _chunks(chunk, spans, edge_index):
            cut = cutoff[start:end] if cutoff is not None else None
            out[r_lo:r_hi] += _fused_chunk(block, call, table[s_lo:s_hi], table[r_lo:r_hi], edge_attrs[start:end],
                                           edge_feats[start:end], cut, sender, receiver)
        return out

    @staticmethod
    def backward(ctx, grad):
        table, edge_attrs, edge_feats, cutoff, edge_index = ctx.saved_tensors
        want = ctx.want
        grad_table = torch.zeros_like(table) if want[0] else None
        grad_attrs = torch.zeros_like(edge_attrs) if want[1] else None
        grad_feats = torch.zeros_like(edge_feats) if want[2] else None
        grad_cut = torch.zeros_like(cutoff) if want[3] else None
        if ctx.vjp is not None:
            from mlipdd_mace.cueq import FIRED

            FIRED["mace_cueq:fused_conv_chunked_vjp"] += 1
        grad = grad.contiguous()
        for start, end, s_lo, s_hi, r_lo, r_hi, sender, receiver in _chunks(ctx.chunk, ctx.spans, edge_index):
            cut = cutoff[start:end] if cutoff is not None else None
            if ctx.vjp is not None:
                parts = _vjp_chunk(ctx.block, ctx.vjp, grad[r_lo:r_hi], table[s_lo:s_hi], edge_attrs[start:end],
                                   edge_feats[start:end], cut, sender, receiver, want)
            else:
                parts = _recomputed_chunk(ctx.block, ctx.call, table, s_lo, s_hi, r_lo, r_hi, grad,
                                          edge_attrs[start:end], edge_feats[start:end], cut, sender, receiver, want)
            g_read, g_attrs, g_feats, g_cut = parts
            if g_read is not None:
                grad_table[s_lo:s_hi] += g_read
            for target, g in ((grad_attrs, g_attrs), (grad_feats, g_feats), (grad_cut, g_cut)):
                if g is not None:
                    target[start:end] = g
        return None, None, None, grad_table, grad_attrs, grad_feats, grad_cut, None, None


def fused_edge_messages(block, chunk, up, edge_attrs, edge_feats, cutoff, edge_index, spans_cache):
    """The fused convolution's summed messages on every node row, ``chunk`` edges at a time.

    NOTE [chunked fused convolution under DD]: the chunks call the kernel on plain tensors
    inside one adapted call (NOTE [chunked MACE under the aten dispatch]): the table is this
    rank's node rows (halo ``[owned | ghost]``, sharded ``[owned | request table]``), and
    the core completes the one scatter into node rows per layer (``ScatterOutputs``).
    """
    from mlipdd.shard import call_adapted
    from mlipdd_mace.chunked import MESSAGES_ADAPTER
    from mlipdd_mace.cueq import FIRED

    FIRED["mace_cueq:fused_conv_chunked"] += 1  # a test that never got here tests nothing
    # one process, or distributed: NOTE [chunked MACE under the aten dispatch]
    return call_adapted(MESSAGES_ADAPTER, _fused_summed_messages, up, edge_attrs, edge_feats, cutoff, edge_index,
                        block=block, chunk=chunk, spans_cache=spans_cache)


def _fused_summed_messages(table, edge_attrs, edge_feats, cutoff, index, *, block, chunk, spans_cache):
    """This rank's fused messages summed by receiver on every row of ``table`` (plain rows:
    halo ``[owned | ghost]``, sharded ``[owned | request table]``)."""
    separate = _polynomial_call(block.conv_tp) is not None
    spans = spans_of(spans_cache, index, chunk, table.shape[0], separate)
    width = block.linear.irreps_in.dim  # the messages feed the block's linear
    return FusedEdgeChunkedMessages.apply(block, chunk, spans, table, edge_attrs, edge_feats, cutoff, index, width)
