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
one kernel, mace's default on CUDA) is chunked the same way in `mlipdd_mace.chunked_fused`,
whose backward applies the kernel's own vector-Jacobian product to recomputed radial weights.

The radial weights ``R(f_e) * c_e`` (the widest per-edge tensor: ~1.3k floats for medium
MACE) are made with the cutoff applied to the input of the radial MLP's last, bias-free
linear layer (`radial_weights`), so no weights-sized product (nor its backward) exists.

Exactness: the same operations on the same numbers; only the summation order of the
messages and where the cutoff multiplies change (float64: ~1e-15 relative; float32:
reorder noise).

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

from mlipdd.shard import call_adapted, local
from mlipdd.spec import OpAdapter, ScatterOutputs

# NOTE [chunked MACE under the aten dispatch]
# The chunks compute on plain rows on purpose (nothing per edge is kept), which no per-op
# rule sees into; under the aten dispatch each chunked step is one adapted call
# (`mlipdd.shard.call_adapted`, NOTE [aten op adapters]): the messages read the node rows
# with ghosts current (under sharded storage the request table's rows too: NOTE [adapted
# reads under sharded storage]) and the edge rows, and return per-node sums of this rank's
# edges (``ScatterOutputs``: the core refreshes or delivers them, once per layer); the
# product block reads and returns node rows (row-local). Forward and backward run plain.
MESSAGES_ADAPTER = OpAdapter("mlipdd_mace::chunked_messages", output_transforms={0: ScatterOutputs()})
PRODUCT_ADAPTER = OpAdapter("mlipdd_mace::chunked_product")


def _plain(t):
    return None if t is None else local(t)


def _rows_like(ref: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
    """``plain`` (this rank's rows) carrying ``ref``'s row layout under domain decomposition."""
    return plain


def _bias_free_last_layer(mlp):
    """(the layers before the last, the last) when ``mlp`` is an e3nn `FullyConnectedNet`
    (mace's RealAgnostic blocks' radial MLP) ending in a layer without activation, which is
    then linear in its input (``x @ w``, no bias); else None."""
    from e3nn.nn import FullyConnectedNet

    if not isinstance(mlp, FullyConnectedNet):
        return None
    layers = list(mlp.children())
    last = layers[-1] if layers else None
    if last is None or getattr(last, "act", True) is not None or len(list(last.parameters())) != 1:
        return None
    return layers[:-1], last


def radial_weights(block, edge_feats, cutoff):
    """The convolution's per-edge weights ``R(f) * c``, as mace computes them, except that
    the cutoff scales the input of the radial MLP's linear last layer (``(h * c) @ w``, 16
    wide for medium MACE) rather than its output (``(h @ w) * c``, 1,280 wide): the same
    number up to rounding, without a weights-sized product in the forward, its saved copy
    and its two weights-sized backward products. Other radial MLPs: mace's order."""
    split = None if cutoff is None else _bias_free_last_layer(block.conv_tp_weights)
    if split is None:
        weights = block.conv_tp_weights(edge_feats)
        return weights if cutoff is None else weights * cutoff
    hidden, last = split
    for layer in hidden:
        edge_feats = layer(edge_feats)
    return last(edge_feats * cutoff)


def _chunk_message(block, up, edge_attrs, edge_feats, cutoff, sender):
    """mace's message of one chunk of edges (RealAgnostic*InteractionBlock, un-summed)."""
    return block.conv_tp(up.index_select(0, sender), edge_attrs, radial_weights(block, edge_feats, cutoff))


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


def _summed_messages(up, edge_attrs, edge_feats, cutoff, sender, receiver, *, block, chunk):
    return EdgeChunkedMessages.apply(block, chunk, up, edge_attrs, edge_feats, cutoff, sender, receiver)


def edge_messages(block, chunk, up, edge_attrs, edge_feats, cutoff, edge_index):
    """The summed messages on every node row, ``chunk`` edges at a time."""
    # one process, or distributed: NOTE [chunked MACE under the aten dispatch]
    return call_adapted(MESSAGES_ADAPTER, _summed_messages, up, edge_attrs, edge_feats, cutoff,
                        edge_index[0], edge_index[1], block=block, chunk=chunk)


def _interaction_forward(block, chunk_atoms, spans_cache):
    """A forward for a RealAgnostic(Residual)InteractionBlock with chunked messages
    (``spans_cache``: the fused chunks' row spans, shared by the layers of one forward)."""
    from mlipdd_mace.chunked_fused import fused_edge_messages

    residual = type(block).__name__ == "RealAgnosticResidualInteractionBlock"

    def forward(self, node_attrs, node_feats, edge_attrs, edge_feats, edge_index, cutoff=None,
                lammps_class=None, lammps_natoms=(0, 0), first_layer=False):
        sc = self.skip_tp(node_feats, node_attrs) if residual else None
        up = self.linear_up(node_feats)
        chunk = _edge_chunk(chunk_atoms, edge_index.shape[1], up.shape[0])
        if hasattr(self, "conv_fusion"):
            message = fused_edge_messages(self, chunk, up, edge_attrs, edge_feats, cutoff, edge_index, spans_cache)
        else:
            message = edge_messages(self, chunk, up, edge_attrs, edge_feats, cutoff, edge_index)
        message = self.linear(message) / self.avg_num_neighbors
        if not residual:
            message = self.skip_tp(message, node_attrs)
        return self.reshape(message), sc

    return types.MethodType(forward, block)


def _product_forward(block, chunk_atoms, original):
    """The product block's own forward, ``chunk_atoms`` rows at a time, recomputed in backward."""

    def chunked(node_feats, sc, node_attrs):
        plain = (_plain(node_feats), _plain(sc), _plain(node_attrs))
        n = plain[0].shape[0]
        if n == 0:  # a rank owning no atom: mace's contraction cannot reshape zero rows (view(0, -1))
            one = [None if t is None else t.new_zeros((1, *t.shape[1:])) for t in plain]
            return _rows_like(node_feats, original(*one)[:0])
        if n <= chunk_atoms:
            return original(node_feats, sc, node_attrs)
        parts = []
        for start in range(0, n, chunk_atoms):
            rows = [None if t is None else t[start:start + chunk_atoms] for t in plain]
            parts.append(checkpoint(original, *rows, use_reentrant=False))
        return _rows_like(node_feats, torch.cat(parts))

    def forward(self, node_feats, sc, node_attrs):
        return call_adapted(PRODUCT_ADAPTER, chunked, node_feats, sc, node_attrs)  # NOTE [chunked MACE under ...]

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
    spans_cache = {}  # one host read of the fused chunks' row spans per forward, not per layer
    try:
        for block in model.interactions:
            if type(block).__name__ in CHUNKABLE_INTERACTIONS:
                block.forward = _interaction_forward(block, chunk_atoms, spans_cache)
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


# Weights-sized tensors (in units of 2 x (weights + radial hidden) per edge) alive at a fused
# chunk's peak, fitted to the first chunked version's H200 peaks. Its backward held the
# recomputed weights (saved by the kernel's autograd) and their gradient; the VJP backward
# holds the same two (mace's default model has no cutoff product: the envelope scales the
# radial features), so the fit stands; a model with apply_cutoff=False now keeps one fewer.
# Re-check on the GPU (.old/gpu/cueq_chunk_fused.py prints peak and estimate).
FUSED_CHUNK_WEIGHTS = 0.84


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
    mace_cueq_gpu.md, cueq_chunk_fused_h200.md). Chunked: 1.45 node tensors per layer kept
    (fitted to the first chunked version's two H200 peaks: 27k atoms at chunk 8192, 5.5 GiB;
    1M at 16384, 82.9 GiB) and `FUSED_CHUNK_WEIGHTS` of a chunk's edge weights alive.
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
                     + rows * (FUSED_CHUNK_WEIGHTS * edges_per_atom * chunk_edge_layer + 2 * d["mid"] + 2 * d["up"]))
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
