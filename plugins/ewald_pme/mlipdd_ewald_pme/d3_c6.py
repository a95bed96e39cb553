"""The C6 coefficient of every D3 pair, in chunks of edges, as one custom op.

NOTE [chunked D3 pairs]. ``C6_e = w_s^T C6ref(Z_s, Z_r) w_r`` reads a 7x7 reference block per
edge. Gathered for all edges at once (as an ``(E, 7, 7)`` tensor, kept by autograd for the
backward) it was the largest tensor of a D3 call by far: 196 bytes per edge in float32, out
of ~700 in all; on an H200 97k atoms at 10 A (18M edges) peaked at 12 GiB and 1M atoms did
not fit. The op below walks the edges in chunks of ``chunk`` edges, so a block tensor never
holds more than one chunk, and its backward is the analytic one (``dC6/dw_s = C6ref w_r``,
``dC6/dw_r = C6ref^T w_s``), chunk by chunk, keeping nothing but its inputs. Each edge's sum
is the same arithmetic whatever the chunk, so chunked and unchunked results agree to
rounding. Everything else of the pair term is a handful of per-edge scalars (see
`D3Wrapper.memory_estimate`).

The op reads edge rows only (the two ends' weights gathered by the caller), so under domain
decomposition it is row-local on the edges of any storage: its OpAdapter (spec
``SPEC_DFTD3_HALO``) declares no transform, and its output is this rank's edge rows.
"""

from __future__ import annotations

import torch

C6_OP = "mlipdd_ewald_pme::d3_pair_c6"
DEFAULT_CHUNK = 1 << 19  # edges: a (chunk, 7, 7) block is 100 MB in float32


def _blocks(pair, table, start: int, stop: int):
    return table[pair[start:stop]]  # (chunk, 7, 7)


@torch.library.custom_op(C6_OP, mutates_args=())
def pair_c6(w_sender: torch.Tensor, w_receiver: torch.Tensor, pair: torch.Tensor, table: torch.Tensor,
            chunk: int) -> torch.Tensor:
    """``C6_e = sum_ab w_sender[e, a] table[pair[e], a, b] w_receiver[e, b]``, ``chunk`` edges at a time.

    ``table``: the (Z*Z, 7, 7) reference blocks, ``pair``: each edge's row of it."""
    out = w_sender.new_empty(w_sender.shape[0])
    for start in range(0, len(out), chunk):
        stop = start + chunk
        out[start:stop] = torch.einsum("ea,eab,eb->e", w_sender[start:stop], _blocks(pair, table, start, stop),
                                       w_receiver[start:stop])
    return out


@pair_c6.register_fake
def _(w_sender, w_receiver, pair, table, chunk):
    return w_sender.new_empty(w_sender.shape[0])


def _save(ctx, inputs, output):
    w_sender, w_receiver, pair, table, chunk = inputs
    ctx.save_for_backward(w_sender, w_receiver, pair, table)
    ctx.chunk = chunk


def _backward(ctx, grad):
    w_sender, w_receiver, pair, table = ctx.saved_tensors
    grad_sender, grad_receiver = torch.empty_like(w_sender), torch.empty_like(w_receiver)
    for start in range(0, len(grad), ctx.chunk):
        stop = start + ctx.chunk
        blocks = _blocks(pair, table, start, stop)
        g = grad[start:stop, None]
        grad_sender[start:stop] = g * torch.einsum("eab,eb->ea", blocks, w_receiver[start:stop])
        grad_receiver[start:stop] = g * torch.einsum("ea,eab->eb", w_sender[start:stop], blocks)
    return grad_sender, grad_receiver, None, None, None


pair_c6.register_autograd(_backward, setup_context=_save)
