"""Opaque custom ops with an `OpAdapter` under the aten dispatch (PME's spline ops, fused kernels).

# NOTE [aten op adapters]
A kernel reads raw buffers, so no aten rule can say what it does with rows; its
OpAdapter in the spec says it, per argument and output. Below autograd the op's own
``register_autograd`` formula would run on ShardTensors whose meaning it cannot know,
so the adapter acts ABOVE autograd, in a torch-function mode the spatial strategies enter
when the spec declares custom ops: the op runs on plain local tensors as one autograd
node (`_Adapted`), whose backward runs the op's own formula on plain tensors too, with
the dispatch's modes off (a formula that re-runs the op would otherwise get replicated
ShardTensors from its ``torch.zeros``: NOTE [aten factories]); the node's two ends say
what the plain values and gradients mean. Once differentiable (forces and stress).

An op that reads no distributed rows (all arguments replicated or plain) is left to the
aten dispatch: every rank computes the same thing (rule 1 of NOTE [aten precedence]).
An op that reads rows computes this rank's part of the global op, so

* inputs: ``SliceOwned`` -> the owned rows; none / ``GatherInputs`` -> every local row,
  ghosts holding their owners' values; edge rows and replicated values as they are.
  Gradients come back as this rank's part: atom rows as SHARES, a replicated value's
  (a mesh, a plain cell) summed over ranks at once;
* outputs: ``AllReduceSum`` -> summed over ranks, replicated (its gradient is the
  replicated gradient, handed on as it is); ``ScatterOutputs`` -> SHARES rows (its
  gradient: every copy's); none -> atom rows (GHOSTED) when the op read atom rows and
  the output has this rank's atom rows, OWNED atom rows when it read owned rows
  (``SliceOwned``) and the output has this rank's owned count (padded with ghost rows
  of no meaning: the aten tensor has the forward's row count; a later read fills them,
  its gradient is the owned rows' whole gradient), edge rows when it read edge rows and
  has this rank's edge count; anything else is refused: a rank-local value of no known
  meaning.
* ``GatherInputsFull`` (on every argument that holds rows) / ``SliceOutputsOwned``:
  every rank runs the op on the whole system (NOTE [aten full rows]).

# NOTE [adapted reads under sharded storage]
Under sharded storage an edge index names rows of ``[owned | request table]`` (NOTE [aten
sharded storage]), so an op that reads an edge index (edge rows whose values are atom
rows) gets every atom-row argument without a transform as those rows, the remote ones
fetched from their owners, as ``index_select`` by the index would; an output of that many
rows is a copy per row (narrowed to the owned rows) or, with ``ScatterOutputs()``, sums
that the request-table rows deliver to their owners (a scatter by the index). Gradients
take the adjoint routes: a table row's gradient goes to its owner, a delivered sum's
gradient is fetched onto every table row.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from mlipdd.shard.aten import comm
from mlipdd.shard.aten.full_rows import FullRows
from mlipdd.shard.aten.placement import EDGES, GHOSTED, OWNED, REPLICATE, SHARES, Rows
from mlipdd.shard.aten.rules import as_ghosted, as_owned
from mlipdd.shard.aten.tensor import AtenRefusal, ShardTensor
from mlipdd.shard.custom_ops import _positional, adapter_for
from mlipdd.shard.internal import internal
from mlipdd.spec.transforms import (
    AllReduceSum,
    GatherInputs,
    GatherInputsFull,
    ScatterOutputs,
    SliceOutputsOwned,
    SliceOwned,
)


class AdaptedOps(TorchFunctionMode):
    """NOTE [aten op adapters]; active around the model's forward (`SpatialStrategy.model_scope`)."""

    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        adapter = adapter_for(func)
        if adapter is None or not any(_reads_rows(a) for a in (*args, *kwargs.values())):
            return func(*args, **kwargs)
        return call_adapted(adapter, func, self.ctx, args, kwargs)


def _reads_rows(a) -> bool:
    if isinstance(a, (list, tuple)):
        return any(_reads_rows(x) for x in a)
    return isinstance(a, ShardTensor) and isinstance(a._place, Rows)


def _refuse(where: str, why: str, fix: str):
    raise AtenRefusal(f"mlipdd aten dispatch refuses {where}: {why}. Fix: {fix}.")


def call_adapted(adapter, func, ctx, args, kwargs):
    where = f"OpAdapter({adapter.qualified_name})"
    args, kwargs = _positional(func, args, kwargs)
    tensors, roles = [], []

    def slot(transform, a, what):
        if isinstance(a, (list, tuple)):
            if transform is not None:
                _refuse(what, f"{type(transform).__name__}() on a list", "key the transform to a tensor argument")
            return type(a)(slot(None, x, what) for x in a)
        if not isinstance(a, torch.Tensor):
            return a
        tensors.append(a)
        roles.append(_role(transform, a, what))
        return _Slot(len(tensors) - 1)

    template = ([slot(adapter.arg_transforms.get(i), a, f"{where} argument {i}") for i, a in enumerate(args)],
                {k: slot(None, v, f"{where} argument {k!r}") for k, v in kwargs.items()})
    local = set(roles) & {"owned", "ghosted", "edges"}
    if "full" in roles and local:
        _refuse(where, f"GatherInputsFull() on some arguments and this rank's {'/'.join(sorted(local))} rows on "
                "others: the op would mix the whole system with one rank's part",
                "declare GatherInputsFull() on every argument that holds atom rows")
    call = _Call(func, template, roles, adapter.output_transforms, ctx, where)
    # NOTE [adapted reads under sharded storage]
    call.table = ctx.reads if ctx.reads is not None and any(
        isinstance(t, ShardTensor) and isinstance(t._place, Rows) and t._place.kind == EDGES
        and t._place.values == "atoms" for t in tensors) else None
    if call.table is not None:
        for t, r in zip(tensors, roles):
            if r == "ghosted" and (t._place.dim != 0 or t._place.group != 1):
                _refuse(where, f"it reads an edge index under sharded storage and {t._place} rows, not one row "
                        "per atom along dim 0", "hand the op atom rows along dim 0 (x.reshape(n, -1))")
    out = _Adapted.apply(call, *tensors)
    return out if call.several else out[0]


class _Slot:
    def __init__(self, index: int):
        self.index = index


def _fill(tree, values):
    if isinstance(tree, _Slot):
        return values[tree.index]
    if isinstance(tree, (list, tuple)):
        return type(tree)(_fill(x, values) for x in tree)
    return tree


def _role(transform, a, where) -> str:
    """What the op reads of ``a``: "owned" / "ghosted" atom rows, "full" (every atom),
    "edges", "replicated"."""
    if transform is not None and not isinstance(transform, (SliceOwned, GatherInputs, GatherInputsFull)):
        _refuse(where, f"{type(transform).__name__}() is an output transform", "move it to output_transforms")
    p = a._place if isinstance(a, ShardTensor) else None
    if not isinstance(p, Rows):
        if transform is not None:
            _refuse(where, f"{type(transform).__name__}() on {tuple(a.shape)} {p or 'plain'}, which holds no "
                    "distributed rows", "key the transform to the per-atom argument")
        return "replicated"
    if not p.is_atoms():
        if transform is not None:
            _refuse(where, f"{type(transform).__name__}() on edge rows", "key the transform to atom rows")
        return "edges"
    if isinstance(transform, GatherInputsFull):
        if p.dim != 0 or p.group != 1 or p.values == "atoms":
            _refuse(where, f"GatherInputsFull() on {p}", "key it to a tensor with one row per atom along dim 0 "
                    "whose values are not this rank's row numbers")
        return "full"
    return "owned" if isinstance(transform, SliceOwned) else "ghosted"


class _Call:
    """One adapted call: the op, where its tensors go, what they and its outputs mean."""

    def __init__(self, func, template, roles, output_transforms, ctx, where):
        self.func, self.template, self.roles, self.ctx, self.where = func, template, roles, ctx, where
        self.output_transforms = output_transforms
        self.several = True
        self.full = FullRows.of(ctx) if "full" in roles else None  # NOTE [aten full rows]
        self.table = None  # sharded storage, an op reading an edge index: the request table's plan

    def local_input(self, a, role):
        if role == "replicated":
            return a._local if isinstance(a, ShardTensor) else a
        if role == "edges":
            return a._local
        if role == "owned":
            return as_owned(a).narrow(a._place.dim, 0, self.ctx.n_owned * a._place.group)
        if role == "full":
            return self.full.gather(as_owned(a).narrow(0, 0, self.ctx.n_owned))
        if self.table is not None:  # NOTE [adapted reads under sharded storage]
            return comm.fetch(as_ghosted(a), 0, self.table)
        return as_ghosted(a)


class _Adapted(torch.autograd.Function):
    """The op on plain local tensors, as one autograd node (NOTE [aten op adapters])."""

    @staticmethod
    @internal  # its own buffers and zero gradients stay plain (NOTE [internal factories])
    def forward(fctx, call, *tensors):
        plain = [call.local_input(t, r).detach().requires_grad_(t.requires_grad) for t, r in zip(tensors, call.roles)]
        args, kwargs = _fill(call.template, plain)
        with torch.enable_grad(), _disable_current_modes():
            out = call.func(*args, **kwargs)
        call.several = isinstance(out, (tuple, list))
        outputs = list(out) if call.several else [out]
        call.kinds = [_output_kind(call.output_transforms.get(i), o, call, f"{call.where} output {i}")
                      for i, o in enumerate(outputs)]
        fctx.call, fctx.plain, fctx.outputs = call, plain, outputs
        fctx.places = [t._place if isinstance(t, ShardTensor) else None for t in tensors]
        done = [_wrap_output(o, kind, call) for o, kind in zip(outputs, call.kinds)]
        fctx.mark_non_differentiable(*[d for d, kind in zip(done, call.kinds) if kind is None
                                       and isinstance(d, torch.Tensor)])
        return tuple(done)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @internal
    def backward(fctx, *grads):
        call = fctx.call
        pairs = [(o, _plain_grad(g, kind, call)) for o, g, kind in zip(fctx.outputs, grads, call.kinds)
                 if kind is not None and g is not None and o.requires_grad]
        wanted = [i for i, t in enumerate(fctx.plain) if t.requires_grad]
        found = [None] * len(wanted)
        if pairs and wanted:
            with _disable_current_modes():
                found = torch.autograd.grad([o for o, _ in pairs], [fctx.plain[i] for i in wanted],
                                            [g for _, g in pairs], allow_unused=True)
        back = [None] * len(fctx.plain)
        for i, g in zip(wanted, found):
            back[i] = _input_grad(g, call.roles[i], fctx.plain[i], fctx.places[i], call)
        return (None, *back)


# ---- what the values and gradients mean at the two ends -----------------------------------
def _output_kind(transform, o, call, where):
    """"summed" (AllReduceSum), "shares" (ScatterOutputs), "ghosted" / "owned" / "edges"
    rows, "sliced" / "replicated" (NOTE [aten full rows]), or None (not a tensor: an int, a size)."""
    if not isinstance(o, torch.Tensor):
        return None
    ctx, roles = call.ctx, set(call.roles)
    rows = o.shape[0] if o.dim() else None
    if isinstance(transform, SliceOutputsOwned):
        if call.full is None:
            _refuse(where, "SliceOutputsOwned() after no GatherInputsFull() argument: the op saw this rank's "
                    "rows, not the whole system", "declare GatherInputsFull() on the per-atom arguments")
        if rows != call.full.n_global:
            _refuse(where, f"SliceOutputsOwned() on {tuple(o.shape)}, not one row per atom of the batch "
                    f"({call.full.n_global})", "key SliceOutputsOwned to the per-atom output")
        return "sliced"
    if call.full is not None:  # every rank computed the same global value
        if transform is not None:
            _refuse(where, f"{type(transform).__name__}() after GatherInputsFull(): every rank computed the "
                    "whole system, so there is no per-rank part to combine",
                    "drop the output transform (the output is the same on every rank), or SliceOutputsOwned()")
        return "replicated"
    if isinstance(transform, AllReduceSum):
        return "summed"
    if call.table is not None and "ghosted" in roles:  # NOTE [adapted reads under sharded storage]
        if isinstance(transform, ScatterOutputs):  # delivered on every rank alike: a collective
            if rows != call.table.n_padded:  # (an empty table has as many rows as this rank owns)
                _refuse(where, f"ScatterOutputs() on {tuple(o.shape)}, not one row per row it read under sharded "
                        f"storage ({call.table.n_padded}: [owned | request table])",
                        "return the sums on every row the edge index names")
            return "table shares"
        if rows == call.table.n_padded != ctx.n_padded:
            return "table copies"  # no exchange: a rank with an empty table takes them as atom rows alike
    if isinstance(transform, ScatterOutputs):
        if rows != ctx.n_padded:
            _refuse(where, f"ScatterOutputs() on {tuple(o.shape)}, not this rank's {ctx.n_padded} atom rows",
                    "key ScatterOutputs to the per-atom output")
        return "shares"
    read_atoms, read_edges = bool(roles & {"owned", "ghosted"}), "edges" in roles
    owned = rows == ctx.n_owned != ctx.n_padded and "owned" in roles
    if (rows == ctx.n_padded and read_atoms or owned) and read_edges:
        _refuse(where, "it read edge rows and returns atom rows: a sum over this rank's edges, or a per-atom "
                "value?", "declare ScatterOutputs() for this output if it sums edges into atoms")
    if rows == ctx.n_padded and read_atoms:
        return "ghosted"
    if owned:
        return "owned"
    if rows == ctx.n_edges and read_edges:
        return "edges"
    _refuse(where, f"it read distributed rows and returns {tuple(o.shape)}, neither this rank's atom rows "
            f"({ctx.n_padded}, or {ctx.n_owned} owned after SliceOwned()) nor its edge rows ({ctx.n_edges}): "
            "a value of this rank alone", "declare AllReduceSum() for this output if it is a partial sum over the rows")


def _wrap_output(o, kind, call):
    ctx = call.ctx
    if kind is None:
        return o
    o = o.detach()
    if kind == "summed":
        return ShardTensor(comm.all_reduce(o.contiguous(), ctx.group), REPLICATE, ctx, "an AllReduceSum output")
    if kind == "replicated":
        return ShardTensor(o, REPLICATE, ctx, "an adapted op's output (GatherInputsFull)")
    if kind == "sliced":
        return ShardTensor(call.full.slice(o), Rows(0, GHOSTED), ctx, "a SliceOutputsOwned output")
    if kind == "table shares":  # each request-table row's sum to its owner
        return ShardTensor(comm.deliver(o, 0, call.table), Rows(0, SHARES), ctx, "an adapted op's output")
    if kind == "table copies":  # the owners' rows are the values
        return ShardTensor(o.narrow(0, 0, ctx.n_owned), Rows(0, GHOSTED), ctx, "an adapted op's output")
    if kind == "owned":  # the forward's row count; the ghost rows mean nothing (OWNED)
        o = torch.cat([o, o.new_zeros((ctx.n_padded - ctx.n_owned, *o.shape[1:]))])
    place = {"shares": Rows(0, SHARES), "ghosted": Rows(0, GHOSTED), "owned": Rows(0, OWNED),
             "edges": Rows(0, EDGES)}[kind]
    return ShardTensor(o, place, ctx, "an adapted op's output")


def _plain_grad(g, kind, call):
    """An output's gradient as the plain op's formula takes it: this rank's part of the
    global gradient of what it computed locally (the global gradient after GatherInputsFull)."""
    ctx = call.ctx
    if kind == "sliced":  # this rank's shares, placed by atom id and summed over ranks
        return call.full.global_gradient(_plain_grad(g, "ghosted", call))
    if kind in ("table shares", "table copies"):
        owned = _plain_grad(g, "owned", call)  # the owned rows' whole gradient
        if kind == "table copies":  # the request-table copies feed nothing further: no gradient
            return torch.cat([owned, owned.new_zeros((call.table.n_padded - ctx.n_owned, *owned.shape[1:]))])
        return comm.fetch(owned, 0, call.table)  # a delivered sum's gradient on every row that fed it
    if not isinstance(g, ShardTensor):
        return g.narrow(0, 0, ctx.n_owned) if kind == "owned" else g
    gp = g._place
    if kind in ("summed", "replicated"):  # the replicated gradient is every partial's / the global one
        if not gp.is_replicate():
            raise AtenRefusal(f"the gradient of a replicated {call.where} output arrived as {gp}")
        return g._local
    if kind == "shares":  # a share's gradient is its atom's, on every copy
        return as_ghosted(g) if isinstance(gp, Rows) else g._local
    if kind == "owned":  # the owned rows' whole gradient (shares summed into them)
        return (as_owned(g) if isinstance(gp, Rows) else g._local).narrow(0, 0, ctx.n_owned)
    if kind == "ghosted":  # copies: the adjoint of the copy is the share
        if isinstance(gp, Rows) and gp.kind == SHARES:
            return g._local
        return comm.zero_ghosts(g._local.contiguous(), 0, ctx.plan)
    return g._local


def _input_grad(g, role, plain, place, call):
    """The plain formula's gradient, from this rank's rows only, is this rank's part: atom
    rows as SHARES, edge rows their own, a replicated value's summed over ranks here (a
    zero part where this rank's rows did not reach it: every rank joins the sum). After
    GatherInputsFull the formula's gradients are global: a replicated value's is the
    total, an atom row's this rank keeps for its owned rows (NOTE [aten full rows])."""
    ctx = call.ctx
    if role == "replicated":
        if call.full is not None:
            total = torch.zeros_like(plain) if g is None else g
        else:
            total = comm.all_reduce((torch.zeros_like(plain) if g is None else g).contiguous(), ctx.group)
        return total if place is None else ShardTensor(total, REPLICATE, ctx, "an adapted op's gradient")
    if g is None:
        return None
    if role == "edges":
        return ShardTensor(g, place.plain_values(), ctx, "an adapted op's gradient")
    if role == "full":
        g = call.full.owned_part(g)
    if role == "ghosted" and call.table is not None:  # a table row's gradient to its owner
        g = comm.deliver(g, 0, call.table)
    if role == "owned":
        pad = list(g.shape)
        pad[place.dim] = ctx.n_padded * place.group - g.shape[place.dim]
        g = torch.cat([g, g.new_zeros(pad)], place.dim)
    return ShardTensor(g, place.as_kind(SHARES).plain_values(), ctx, "an adapted op's gradient")
