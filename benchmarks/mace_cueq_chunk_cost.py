"""Where a chunked fused cuEq force call spends its memory traffic, counted on the CPU.

    PYTHONPATH=core:plugins/mace python benchmarks/mace_cueq_chunk_cost.py --reps 3 --chunks 64

No GPU in CI, so this counts instead of timing: every aten op of one energy + forces call
of medium MACE (128x0e+128x1o, L=3, correlation 3, 6 A, float32, diamond Si), with the bytes
its tensors read and write (views count nothing), and the number of ops (each one a kernel
launch on a GPU). The fused convolution runs on cuequivariance's torch reference code
(`mlipdd_mace.testing.ReferenceFusedConvolution`); what a GPU does in one kernel is counted
as one op whose traffic is its inputs (gathered rows for an indexed input) and outputs, in
the forward and, as the CUDA op's autograd does, in a backward that is the polynomial's VJP
(`mlipdd_mace.chunked_fused._vjp`). Other cuEq layers (linears, the symmetric contraction)
are counted op by op, as the reference code runs them, the same in every variant.
Variants: the plain fused model ("bare"), the first chunked version (recomputing backward,
cutoff on the weights: RECOMPUTE_CONVOLUTION and the cutoff fold off) and the current one.
Writes nothing; prints one table (bytes per atom, ops per call, ops per chunk).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import pathlib
import sys

# benchmarks/mace.py must not shadow mace-torch when this runs as a script
_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE]

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {"view", "_unsafe_view", "slice", "select", "t", "transpose", "detach", "alias", "as_strided", "expand",
         "unsqueeze", "squeeze", "permute", "reshape", "split", "split_with_sizes", "unbind", "narrow", "lift_fresh"}


class Traffic(TorchDispatchMode):
    """Bytes read + written and op count per aten op name (views free); ``kernel`` ops
    (one GPU kernel each) are recorded by `count_kernel` and their insides skipped."""

    def __init__(self):
        super().__init__()
        self.bytes, self.ops, self.inside = collections.Counter(), collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__.rstrip("_")
        if self.inside or name in VIEWS:
            return out
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.bytes[name] += sum(t.numel() * t.element_size() for t in tensors)
        self.ops[name] += 1
        return out


MODE: Traffic | None = None


def count_kernel(module, original, inputs, ii, os_, oi, label):
    rows = [len(ii[k]) if k in ii else t.shape[0] for k, t in enumerate(inputs)]
    read = sum(r * t[0].numel() * t.element_size() for r, t in zip(rows, inputs))
    MODE.inside += 1
    try:
        with torch.no_grad():
            outs = original(module, inputs, ii, os_, oi)
    finally:
        MODE.inside -= 1
    MODE.bytes[label] += read + sum(o.numel() * o.element_size() for o in outs)
    MODE.ops[label] += 1
    return outs


class EmulatedKernel(torch.autograd.Function):
    """A cuEq polynomial as the CUDA op runs it: one kernel forward, and a backward that is
    one kernel of the polynomial's VJP (for every input that requires grad, as a custom op's
    autograd sees it), so the reference code's many small ops do not stand in for it."""

    @staticmethod
    def forward(ctx, module, original, ii, os_, oi, label, *inputs):
        ctx.module, ctx.original, ctx.ii, ctx.oi, ctx.label = module, original, ii, oi, label
        ctx.save_for_backward(*inputs)
        return tuple(count_kernel(module, original, list(inputs), ii, os_, oi, f"{label} fwd"))

    @staticmethod
    def backward(ctx, *grads):
        import cuequivariance_torch as cuet

        inputs = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[6:])
        has = [g is not None for g in grads]
        key = (need, tuple(has))
        cache = vars(ctx.module).setdefault("_cost_vjps", {})
        if key not in cache:
            poly, _ = ctx.module._polynomial_orig.backward(list(need), has)
            cache[key] = cuet.SegmentedPolynomial(poly, method="naive", math_dtype=ctx.module._math_dtype_orig)
        cots = [g.contiguous() for g in grads if g is not None]
        ii = {k: v.long() for k, v in ctx.ii.items()}  # the reference code scatters with int64 only
        for rank, j in enumerate(j for j, h in enumerate(has) if h):
            if j in ctx.oi:
                ii[len(inputs) + rank] = ctx.oi[j].long()
        wanted = [k for k, n in enumerate(need) if n]
        shapes = {i: inputs[k] for i, k in enumerate(wanted)}
        index = {i: ctx.ii[k].long() for i, k in enumerate(wanted) if k in ctx.ii}
        out = iter(count_kernel(cache[key], ctx.original, [*inputs, *cots], ii, shapes, index, f"{ctx.label} bwd"))
        return (None,) * 6 + tuple(next(out) if n else None for n in need)


@contextlib.contextmanager
def emulated_kernels(conv_modules):
    """Every cuEq polynomial call as one kernel (`EmulatedKernel`); ``conv_modules`` are
    labelled "conv kernel", the chunked path's own VJP calls "conv kernel bwd"."""
    import cuequivariance_torch as cuet
    from mlipdd_mace.chunked_fused import _VJPS

    original = cuet.SegmentedPolynomial.forward
    ids = {id(m) for m in conv_modules}

    def forward(self, inputs, input_indices=None, output_shapes=None, output_indices=None):
        ii, os_, oi = input_indices or {}, output_shapes or {}, output_indices or {}
        vjp_of_conv = any(self in per.values() for per in _VJPS.values())
        label = "conv kernel" if id(self) in ids or vjp_of_conv else "other cuEq kernel"
        if vjp_of_conv:
            return count_kernel(self, original, list(inputs), ii, os_, oi, "conv kernel bwd")
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            return list(EmulatedKernel.apply(self, original, ii, os_, oi, label, *inputs))
        return count_kernel(self, original, list(inputs), ii, os_, oi, f"{label} fwd")

    cuet.SegmentedPolynomial.forward = forward
    try:
        yield
    finally:
        cuet.SegmentedPolynomial.forward = original


def fused_medium_model():
    from mlipdd_mace.cueq import to_cueq
    from mlipdd_mace.testing import ReferenceFusedConvolution, mace_medium_config, random_mace

    cfg = mace_medium_config()
    model = to_cueq(random_mace(elements=(14,), r_max=cfg["r_max"], num_interactions=cfg["num_interactions"],
                                hidden_irreps=cfg["hidden_irreps"], max_ell=cfg["max_ell"],
                                correlation=cfg["correlation"], dtype=torch.float32, seed=0), conv_fusion=False)
    for block in model.interactions:
        block.conv_tp = ReferenceFusedConvolution(block.conv_tp, torch.float32)
        block.conv_fusion = True
    return model


def one_call(model, batch, chunk, first_version):
    from mlipdd_mace import chunked, chunked_fused
    from mlipdd_mace.wrapper import MACEWrapper

    global MODE
    chunked_fused.RECOMPUTE_CONVOLUTION = first_version
    fold = chunked._bias_free_last_layer
    if first_version:
        chunked._bias_free_last_layer = lambda mlp: None
    try:
        MODE = Traffic()
        with emulated_kernels([b.conv_tp.polynomial for b in model.interactions]), MODE:
            out = MACEWrapper(model, chunk_atoms=chunk)(batch.clone())
    finally:
        chunked._bias_free_last_layer = fold
        chunked_fused.RECOMPUTE_CONVOLUTION = False
    return out, MODE


def main():
    from mlipdd.lattices import silicon_diamond
    from mlipdd.neighbors import attach_neighbors

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunks", default="64")
    args = p.parse_args()
    model = fused_medium_model()
    batch = silicon_diamond(args.reps).to(dtype=torch.float32)
    # a perfect lattice has zero forces by symmetry: rattle, so the force check means something
    batch.positions = batch.positions + 0.05 * torch.randn(batch.positions.shape, generator=torch.Generator().manual_seed(0))
    n, e = batch.num_atoms, attach_neighbors(batch, float(model.r_max)).edge_index.shape[1]
    print(f"medium fused cuEq, {n} atoms, {e} edges ({e / n:.0f} per atom)")
    variants = [("bare", None, False)]
    for chunk in (int(c) for c in args.chunks.split(",")):
        variants += [(f"first chunked {chunk}", chunk, True), (f"chunked {chunk}", chunk, False)]
    rows, ref = {}, None
    for name, chunk, first in variants:
        out, mode = one_call(model, batch, chunk, first)
        diff = 0.0 if ref is None else float((out["forces"] - ref).abs().max() / ref.abs().max())
        ref = out["forces"] if ref is None else ref
        rows[name] = (mode, diff, None if chunk is None else -(-n // chunk))
    bare = sum(rows["bare"][0].bytes.values())
    print("| variant | KB per atom | vs bare | ops per call | force diff vs bare |")
    print("|---|---|---|---|---|")
    for name, (mode, diff, _) in rows.items():
        total = sum(mode.bytes.values())
        print(f"| {name} | {total / n / 1e3:.0f} | {total / bare:.2f} | {sum(mode.ops.values())} | {diff:.1e} |")
    print("\nKB per atom by op (largest first):")
    names = sorted({k for m, _, _ in rows.values() for k in m.bytes}, key=lambda k: -max(m.bytes[k] for m, _, _ in rows.values()))
    print("| op | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for k in names[:16]:
        print(f"| {k} | " + " | ".join(f"{m.bytes[k] / n / 1e3:.0f} ({m.ops[k]})" for m, _, _ in rows.values()) + " |")


if __name__ == "__main__":
    main()
