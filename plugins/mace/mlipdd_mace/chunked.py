"""Chunked MACE evaluation: the same energy and forces in a fraction of the memory.

A plain MACE forward + force backward keeps every per-edge tensor of every layer alive
until the backward pass (the tensor-product messages are ~5k floats per edge for a
medium model, ~45 edges per atom), and the symmetric contraction keeps ~100k floats per
atom. That is ~3.7 GiB per 1k atoms for medium MACE, so one H200 stops near 35k atoms.

`chunked_blocks(model, chunk_atoms)` swaps, for the duration of one forward, the
forward of each interaction and product block for one that

* computes the messages of ``chunk_atoms * edges_per_atom`` edges at a time and adds
  them into the per-node message (`EdgeChunkedMessages`); nothing per edge is kept:
  the backward recomputes each chunk's radial MLP and tensor product and hands back
  gradients for the node features, the spherical harmonics, the radial features and
  the cutoff envelope (hence positions, strain and forces);
* runs the product block (symmetric contraction, row-wise) ``chunk_atoms`` rows at a
  time under `torch.utils.checkpoint` (recomputed in the backward);

and parameters are frozen (``requires_grad=False``) so no layer keeps its input for a
weight gradient nobody asks for. Everything else is mace's own code.

cuEquivariance's fused convolution (``conv_fusion``: gather, product and receiver sums in
one kernel, mace's default on CUDA) keeps no message per edge but does keep each edge's
radial weights for its backward (~1.3k floats per edge and layer for medium MACE: ~440 GiB
at 1M atoms). `FusedEdgeChunkedMessages` calls the same kernel on ``chunk`` edges at a time,
handing it only the node-table rows those edges read and sum into (`_row_spans`), and
recomputes each chunk's weights in the backward.

Exactness: the same operations on the same numbers; only the summation order of the
messages changes (float64: ~1e-15 relative; float32: reorder noise).

Domain decomposition: the chunks compute on this rank's plain rows, and the one node
scatter that finishes a layer's messages is an ordinary ``index_add`` into node rows,
which the core's dispatch turns into the usual ghost-row exchange, once per layer as in
the plain model, so every rank issues the same collectives whatever its chunk count.
Under sharded storage the remote senders' rows are fetched once per layer, before the
chunks (`edge_messages`).

Inference only: the custom backward is not itself differentiable, so training (which
needs forces' gradients) runs the plain model (`MACEWrapper` falls back to it).
"""

from __future__ import annotations

import contextlib
import math
import types

import torch
from torch.utils.checkpoint import checkpoint

from mlipdd.models import capturing
from mlipdd.shard import ShardTensor, local


def _plain(t):
    return None if t is None else local(t)


def _rows_like(ref: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
    """``plain`` (this rank's rows) carrying ``ref``'s row layout under domain decomposition."""
    return ShardTensor.wrap(plain, ref.meta) if isinstance(ref, ShardTensor) else plain


def _chunk_message(block, up, edge_attrs, edge_feats, cutoff, sender):
    """mace's message of one chunk of edges (RealAgnostic*InteractionBlock, un-summed)."""
    weights = block.conv_tp_weights(edge_feats)
    if cutoff is not None:
        weights = weights * cutoff
    return block.conv_tp(up.index_select(0, sender), edge_attrs, weights)


class EdgeChunkedMessages(torch.autograd.Function):
    """``sum over edges e -> i of conv_tp(up[sender_e], Y_e, R(f_e) * c_e)`` per node ``i``,
    ``chunk`` edges at a time, with a recomputing backward (no per-edge tensor is kept)."""

    @staticmethod
    def forward(ctx, block, chunk, up, edge_attrs, edge_feats, cutoff, sender, receiver):
        ctx.block, ctx.chunk, ctx.has_cutoff = block, chunk, cutoff is not None
        ctx.save_for_backward(up, edge_attrs, edge_feats, cutoff, sender, receiver)
        out = up.new_zeros((up.shape[0], block.conv_tp.irreps_out.dim))
        for start in range(0, sender.shape[0], chunk):
            end = start + chunk
            cut = cutoff[start:end] if cutoff is not None else None
            message = _chunk_message(block, up, edge_attrs[start:end], edge_feats[start:end], cut,
                                     sender[start:end])
            out.index_add_(0, receiver[start:end], message)
        return out

    @staticmethod
    def backward(ctx, grad):
        up, edge_attrs, edge_feats, cutoff, sender, receiver = ctx.saved_tensors
        want = ctx.needs_input_grad
        grad_up = torch.zeros_like(up) if want[2] else None
        grad_attrs = torch.zeros_like(edge_attrs) if want[3] else None
        grad_feats = torch.zeros_like(edge_feats) if want[4] else None
        grad_cut = torch.zeros_like(cutoff) if ctx.has_cutoff and want[5] else None
        for start in range(0, sender.shape[0], ctx.chunk):
            end = start + ctx.chunk
            s = sender[start:end]
            with torch.enable_grad():
                x = up.index_select(0, s).detach().requires_grad_(want[2])
                a = edge_attrs[start:end].detach().requires_grad_(want[3])
                f = edge_feats[start:end].detach().requires_grad_(want[4])
                c = cutoff[start:end].detach().requires_grad_(grad_cut is not None) if ctx.has_cutoff else None
                message = _chunk_message(ctx.block, x, a, f, c, torch.arange(x.shape[0], device=x.device))
                inputs = [t for t in (x, a, f, c) if t is not None and t.requires_grad]
                grads = iter(torch.autograd.grad(message, inputs, grad.index_select(0, receiver[start:end]))
                             if inputs else ())
            if x.requires_grad:
                grad_up.index_add_(0, s, next(grads))
            for target, t in ((grad_attrs, a), (grad_feats, f), (grad_cut, c)):
                if t is not None and t.requires_grad:
                    target[start:end] = next(grads)
        return None, None, grad_up, grad_attrs, grad_feats, grad_cut, None, None


def edge_messages(block, chunk, up, edge_attrs, edge_feats, cutoff, edge_index):
    """The summed messages on every node row, ``chunk`` edges at a time."""
    senders = up
    if isinstance(up, ShardTensor) and up.meta.layout.is_sharded():
        # Sharded storage: a sender may be another rank's atom. Fetch every row the edges
        # read ([owned | request table]) in one routed read per layer, the same collective
        # on every rank whatever its chunk count; the chunks then index it locally.
        table_rows = torch.arange(up.meta.plan.n_padded, device=local(up).device)
        senders = up.index_select(0, table_rows)
    partial = EdgeChunkedMessages.apply(
        block, chunk, _plain(senders), _plain(edge_attrs), _plain(edge_feats), _plain(cutoff),
        _plain(edge_index[0]), _plain(edge_index[1]),
    )[: local(up).shape[0]]  # receivers are node rows (owned ones under sharded storage)
    return _into_node_rows(up, partial)


def _into_node_rows(up, partial):
    """``partial`` (this rank's sums on plain rows) as the node rows of ``up``'s layout."""
    if not isinstance(up, ShardTensor):
        return partial
    # NOTE [one scatter per layer]: the chunks summed this rank's edges on plain rows; this
    # scatter into node rows is the plain model's `scatter_sum`, so under domain
    # decomposition the dispatch refreshes ghost rows here, once, as it does there.
    rows = torch.arange(partial.shape[0], device=partial.device)
    return up.new_zeros(partial.shape).index_add(0, rows, partial)


# ---- the fused cuEquivariance convolution, chunked --------------------------------------------


def _row_spans(edge_index: torch.Tensor, chunk: int, n_rows: int, separate: bool) -> list[tuple[int, int, int, int]]:
    """Per chunk of ``chunk`` edges, the node-table rows ``(read_lo, read_hi, sum_lo, sum_hi)``
    its senders read and its receivers sum into (``separate=False``: one span for both).

    The fused kernel reads senders from and sums into a node table; handing it only the
    rows a chunk touches keeps each call's output (and its backward's sender gradient) at
    the chunk's size instead of the whole system's. Receivers come sorted (mlipdd's
    neighbour lists), so a chunk sums into ~``chunk_atoms`` rows; its senders' span is
    narrow for spatially ordered atoms and wide for a chunk whose neighbours wrap around a
    periodic cell. Any order stays exact (a span is then wider, up to all rows). One host
    sync per layer, not per chunk.
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


def _polynomial_call(conv_tp):
    """The cuEq polynomial behind a fused convolution, callable with separate sender and
    receiver tables: mace's fused block is a `SegmentedPolynomial` keeping that call as
    ``original_forward`` (its ``forward`` only unpacks ``edge_index``), the CPU stand-in
    `mlipdd_mace.testing.ReferenceFusedConvolution` holds it as ``polynomial``. None for
    any other fused form: it is called through its public forward on one joint span."""
    try:
        from cuequivariance_torch import SegmentedPolynomial
    except ImportError:
        return None
    if isinstance(conv_tp, SegmentedPolynomial) and "original_forward" in vars(conv_tp):
        return conv_tp.original_forward
    inner = getattr(conv_tp, "polynomial", None)
    return inner if isinstance(inner, SegmentedPolynomial) else None


def _fused_chunk(block, call, read, sums_like, edge_attrs, edge_feats, cutoff, sender, receiver):
    """mace's fused convolution (gather, product, receiver sums in one call) on one chunk of
    edges: senders index ``read``, receivers ``sums_like``'s rows (both slices of the node
    table); the sums on those rows."""
    weights = block.conv_tp_weights(edge_feats)
    if cutoff is not None:
        weights = weights * cutoff
    if call is None:  # one joint span: read and sums_like are the same rows
        return block.conv_tp(read, edge_attrs, weights, torch.stack([sender, receiver]))
    return call([weights, read, edge_attrs], {1: sender}, {0: sums_like}, {0: receiver})[0]


def _chunks(chunk, spans, edge_index):
    """(start, end, read_lo, read_hi, sum_lo, sum_hi, local senders, local receivers) per chunk."""
    for start, (s_lo, s_hi, r_lo, r_hi) in zip(range(0, edge_index.shape[1], chunk), spans):
        end = start + chunk
        yield start, end, s_lo, s_hi, r_lo, r_hi, edge_index[0, start:end] - s_lo, edge_index[1, start:end] - r_lo


class FusedEdgeChunkedMessages(torch.autograd.Function):
    """The fused convolution's receiver sums over the node table, ``chunk`` edges per kernel
    call on the rows each chunk touches (`_row_spans`), with a recomputing backward: the
    chunk's radial weights are never kept, as in `EdgeChunkedMessages`."""

    @staticmethod
    def forward(ctx, block, chunk, table, edge_attrs, edge_feats, cutoff, edge_index, width):
        call = _polynomial_call(block.conv_tp)
        spans = _row_spans(edge_index, chunk, table.shape[0], separate=call is not None)
        ctx.block, ctx.chunk, ctx.call, ctx.spans, ctx.has_cutoff = block, chunk, call, spans, cutoff is not None
        ctx.save_for_backward(table, edge_attrs, edge_feats, cutoff, edge_index)
        out = table.new_zeros((table.shape[0], width))
        for start, end, s_lo, s_hi, r_lo, r_hi, sender, receiver in _chunks(chunk, spans, edge_index):
            cut = cutoff[start:end] if cutoff is not None else None
            out[r_lo:r_hi] += _fused_chunk(block, call, table[s_lo:s_hi], table[r_lo:r_hi], edge_attrs[start:end],
                                           edge_feats[start:end], cut, sender, receiver)
        return out

    @staticmethod
    def backward(ctx, grad):
        table, edge_attrs, edge_feats, cutoff, edge_index = ctx.saved_tensors
        want = ctx.needs_input_grad
        grad_table = torch.zeros_like(table) if want[2] else None
        grad_attrs = torch.zeros_like(edge_attrs) if want[3] else None
        grad_feats = torch.zeros_like(edge_feats) if want[4] else None
        grad_cut = torch.zeros_like(cutoff) if ctx.has_cutoff and want[5] else None
        for start, end, s_lo, s_hi, r_lo, r_hi, sender, receiver in _chunks(ctx.chunk, ctx.spans, edge_index):
            with torch.enable_grad():
                x = table[s_lo:s_hi].detach().requires_grad_(want[2])
                a = edge_attrs[start:end].detach().requires_grad_(want[3])
                f = edge_feats[start:end].detach().requires_grad_(want[4])
                c = cutoff[start:end].detach().requires_grad_(grad_cut is not None) if ctx.has_cutoff else None
                sums = _fused_chunk(ctx.block, ctx.call, x, table[r_lo:r_hi], a, f, c, sender, receiver)
                inputs = [t for t in (x, a, f, c) if t is not None and t.requires_grad]
                grads = iter(torch.autograd.grad(sums, inputs, grad[r_lo:r_hi].contiguous()) if inputs else ())
            if x.requires_grad:
                grad_table[s_lo:s_hi] += next(grads)
            for target, t in ((grad_attrs, a), (grad_feats, f), (grad_cut, c)):
                if t is not None and t.requires_grad:
                    target[start:end] = next(grads)
        return None, None, grad_table, grad_attrs, grad_feats, grad_cut, None, None


def fused_edge_messages(block, chunk, up, edge_attrs, edge_feats, cutoff, edge_index):
    """The fused convolution's summed messages on every node row, ``chunk`` edges at a time.

    NOTE [chunked fused convolution under DD]: the chunks call the kernel on plain tensors
    (the sender table of `mlipdd_mace.cueq._sender_table`: halo ``[owned | ghost]`` rows made
    current, sharded ``[owned | request table]`` in one routed read), so the cuEq DD rule
    does not see them; what it would do after its one kernel call, one scatter into node
    rows, `_into_node_rows` does after the last chunk. Every rank thus issues the same
    collectives (one table read or refresh, one scatter per layer) whatever its chunk count.
    """
    from mlipdd.shard import FIRED
    from mlipdd_mace.cueq import _sender_table

    FIRED["mace_cueq:fused_conv_chunked"] += 1  # a test that never got here tests nothing
    table = _sender_table(up) if isinstance(up, ShardTensor) else up
    index = _plain(edge_index)
    width = block.linear.irreps_in.dim  # the messages feed the block's linear
    partial = FusedEdgeChunkedMessages.apply(
        block, chunk, _plain(table), _plain(edge_attrs), _plain(edge_feats), _plain(cutoff), index, width,
    )[: local(up).shape[0]]
    return _into_node_rows(up, partial)


def _interaction_forward(block, chunk_atoms):
    """A forward for a RealAgnostic(Residual)InteractionBlock with chunked messages."""
    residual = type(block).__name__ == "RealAgnosticResidualInteractionBlock"

    def forward(self, node_attrs, node_feats, edge_attrs, edge_feats, edge_index, cutoff=None,
                lammps_class=None, lammps_natoms=(0, 0), first_layer=False):
        sc = self.skip_tp(node_feats, node_attrs) if residual else None
        up = self.linear_up(node_feats)
        chunk = _edge_chunk(chunk_atoms, edge_index.shape[1], up.shape[0])
        messages = fused_edge_messages if hasattr(self, "conv_fusion") else edge_messages
        message = messages(self, chunk, up, edge_attrs, edge_feats, cutoff, edge_index)
        message = self.linear(message) / self.avg_num_neighbors
        if not residual:
            message = self.skip_tp(message, node_attrs)
        return self.reshape(message), sc

    return types.MethodType(forward, block)


def _product_forward(block, chunk_atoms, original):
    """The product block's own forward, ``chunk_atoms`` rows at a time, recomputed in backward."""

    def forward(self, node_feats, sc, node_attrs):
        plain = (_plain(node_feats), _plain(sc), _plain(node_attrs))
        n = plain[0].shape[0]
        if n <= chunk_atoms:
            return original(node_feats, sc, node_attrs)
        parts = []
        for start in range(0, n, chunk_atoms):
            rows = [None if t is None else t[start:start + chunk_atoms] for t in plain]
            parts.append(checkpoint(original, *rows, use_reentrant=False))
        return _rows_like(node_feats, torch.cat(parts))

    return types.MethodType(forward, block)


def _edge_chunk(chunk_atoms: int, n_edges: int, n_nodes: int) -> int:
    return max(1, chunk_atoms * math.ceil(n_edges / max(1, n_nodes)))


CHUNKABLE_INTERACTIONS = ("RealAgnosticInteractionBlock", "RealAgnosticResidualInteractionBlock")


def unsupported_blocks(model) -> list[str]:
    """Interaction blocks the chunked path does not know (it then leaves them as they are)."""
    return [
        type(b).__name__ for b in model.interactions
        if type(b).__name__ not in CHUNKABLE_INTERACTIONS
    ]


@contextlib.contextmanager
def chunked_blocks(model, chunk_atoms: int):
    """Inside the block, ``model``'s interactions and products run chunked (module docstring)."""
    patched = []
    frozen = [p for p in model.parameters() if p.requires_grad]
    try:
        for block in model.interactions:
            if type(block).__name__ in CHUNKABLE_INTERACTIONS:
                block.forward = _interaction_forward(block, chunk_atoms)
                patched.append(block)
        for block in model.products:
            block.forward = _product_forward(block, chunk_atoms, type(block).forward.__get__(block))
            patched.append(block)
        for p in frozen:
            p.requires_grad_(False)
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)
        for block in patched:
            del block.forward  # back to the class's forward


# ---- memory estimate ------------------------------------------------------------------------


def _dims(model) -> dict:
    """Feature widths that set the memory: per edge and per node, per layer. Read from the
    block's own layers around the convolution (the messages feed ``linear``, ``linear_up``
    feeds the senders, the radial MLP gives the weights), so e3nn, unfused and fused cuEq
    blocks (whose convolution is a bare polynomial) all answer."""
    blocks = model.interactions
    first = blocks[0]
    return {
        "layers": len(blocks),
        "mid": max(b.linear.irreps_in.dim for b in blocks),
        "tp_weights": max(b.conv_tp_weights.hs[-1] for b in blocks),
        "radial_hidden": max(sum(b.conv_tp_weights.hs[1:-1]) for b in blocks),
        "up": max(b.linear_up.irreps_out.dim for b in blocks),
        "sh": first.edge_attrs_irreps.dim,
        "hidden": max(p.linear.irreps_out.dim for p in model.products),
        "fused": any(hasattr(b, "conv_fusion") for b in blocks),
    }


def estimate_memory(model, n_atoms: int, n_edges: int, chunk_atoms: int | None, itemsize: int = 4) -> dict:
    """Rough peak bytes of one energy + forces call, from the model's feature widths.

    e3nn and unfused cuEq convolutions: the coefficients (how many tensors of each width
    stay alive) were fitted to peaks measured on an H200 for medium MACE
    (benchmarks/results/mace_memory_wall.md: within ~10 % there; other architectures: a
    rough guide). Plain: per edge and layer the tensor-product messages and their radial
    weights; per node and layer the product's contraction (~``sh**2 * hidden / 2``).
    Chunked: per edge only the geometry (vectors, harmonics, radial features), per node and
    layer the message and the features, plus one chunk's worth of the plain per-edge and
    per-node peaks.

    Fused cuEq convolution (gather, product and receiver sums in one kernel): no message
    exists per edge, and cuEq's symmetric contraction keeps no ``sh**2 * hidden`` products
    per node. Plain: per edge and layer the radial MLP's activations and the weights it
    makes (1.2 of those), per node the messages and features: medium cuEq on one H200,
    16.1 vs 17.0 GiB measured at 27k atoms, 38.2 vs 38.1 at 64k (benchmarks/results/
    mace_cueq_gpu.md, cueq_chunk_fused_h200.md). Chunked: the two coefficients (1.45 node
    tensors per layer kept, 0.84 of a chunk's edge weights alive) are fitted to the two
    chunked H200 peaks (27k atoms at chunk 8192: 5.5 GiB; 1M at 16384: 82.9 GiB), not yet
    checked at a third point.
    """
    d = _dims(model)
    per_edge_geometry = 3 * (3 + 1 + d["sh"] + 8 + 1)
    per_node_product = d["sh"] * d["sh"] * d["hidden"] // 2
    edges_per_atom = n_edges / max(1, n_atoms)
    if d["fused"]:
        node_layer = d["mid"] + d["hidden"]
        if chunk_atoms is None:
            per_edge = per_edge_geometry + d["layers"] * 1.2 * (d["tp_weights"] + d["radial_hidden"])
            total = n_edges * per_edge + n_atoms * d["layers"] * node_layer
        else:
            chunk_edge_layer = 2 * (d["tp_weights"] + d["radial_hidden"]) + d["sh"]
            rows = min(chunk_atoms, n_atoms)
            total = (n_edges * per_edge_geometry + n_atoms * 1.45 * d["layers"] * node_layer
                     + rows * (0.84 * edges_per_atom * chunk_edge_layer + 2 * d["mid"] + 2 * d["up"]))
    elif chunk_atoms is None:
        per_edge = per_edge_geometry + d["layers"] * 1.1 * (d["mid"] + d["tp_weights"])
        per_node = d["layers"] * (d["mid"] + d["hidden"] + 2 * per_node_product)
        total = n_edges * per_edge + n_atoms * per_node
    else:
        chunk_edge_layer = 2 * d["mid"] + 2 * d["tp_weights"] + d["up"]
        rows = min(chunk_atoms, n_atoms)
        total = (n_edges * per_edge_geometry + n_atoms * d["layers"] * (d["mid"] + d["hidden"])
                 + rows * (1.5 * edges_per_atom * chunk_edge_layer + 2 * per_node_product))
    return {"bytes": int(total * itemsize), "atoms": n_atoms, "edges": n_edges, "chunk_atoms": chunk_atoms}
