"""Graph partition under the aten dispatch: the helpers of `mlipdd.shard.graph_partition`
as placement changes of aten ShardTensors.

# NOTE [aten graph partition]
Under graph partition every rank holds the full geometry and owns one block of node
rows (`NodePartition`). The model builds its graph on the full geometry with plain
tensors; a plain tensor here is REPLICATED (every rank computes the same value) and,
as every value of the aten dispatch (NOTE [aten gradients]), its gradient is the
GLOBAL one. The helpers are where rows begin, each an op the rules already know:

* ``keep_owned_receivers``: the edges of owned receivers, read from the full list by
  a kept-edge index of EDGES rows (``edge_index.index_select(1, kept)``, each edge on
  the rank that owns its receiver). Its values stay NODE numbers (rows of the full,
  replicated node set): they read replicated tensors (positions, gathered features),
  never the owned block;
* ``local_receivers``: receiver node numbers -> rows of the owned block (values
  ``"atoms"``): the index that reads and scatters the owned rows;
* ``owned_rows`` / ``scatter_to_owners``: a replicated full tensor read by the owned
  block's node numbers: atom rows (OWNED);
* ``gather_nodes``: owned rows -> the replicated full tensor (one all_gather);
* ``sum_over_ranks``: the identity, since a sum over the rows is already complete and
  replicated by the rules that reduced it.

The owned block has no ghost rows (`comm.OwnedRowsOnly`), so the atom kinds are one.
Gradients need no code: the adjoint of a replicated read by edge or atom rows is a
scatter into a replicated tensor, which the rules all-reduce (NOTE [aten halo rules]);
the adjoint of ``gather_nodes`` keeps the owned block of a gradient already complete.
A model that computes on the owned block with an op without a rule, or reads the owned
block by node numbers, is refused by name, as under halo storage.
"""

from __future__ import annotations

import torch

from mlipdd.shard.aten.placement import EDGES, OWNED, REPLICATE, Rows
from mlipdd.shard.aten.tensor import AtenRefusal, HaloContext, ShardTensor, unwrap

__all__ = ["PartitionContext", "gather_nodes", "keep_owned_receivers", "local_receivers", "owned_rows", "set_edge_count",
           "sum_over_ranks"]


class PartitionContext(HaloContext):
    """The `HaloContext` of a graph-partition forward (the owned block, no ghost rows:
    ``plan=comm.OwnedRowsOnly(n_owned)``), with the fix its refusals name."""

    read_fix = ("read the full node set by node numbers (gather_nodes(h)[sender]) and the owned block by "
                "local_receivers(receiver)")


def _plain_replicated(x, what: str) -> torch.Tensor:
    """``x`` as a replicated tensor (plain, or a replicated ShardTensor); rows refused."""
    if isinstance(x, ShardTensor) and not x._place.is_replicate():
        raise AtenRefusal(
            f"mlipdd aten dispatch refuses `{what}` on {x._place} from `{x._origin}`: it takes a replicated "
            "tensor of the full graph (the model's own graph build on the full geometry). Fix: call it once, on "
            "the full tensors, before any other graph-partition helper")
    return x


def set_edge_count(ctx: HaloContext, n_edges: int) -> None:
    """This rank's edges are known once the model kept them: the counts it checks
    arithmetic against (NOTE [aten counts]) are recounted from here on."""
    ctx.n_edges = int(n_edges)
    for key in ("counts", "edges"):
        ctx._global.pop(key, None)


def keep_owned_receivers(p, ctx: HaloContext, edge_index, edge_values):
    edge_index = _plain_replicated(edge_index, "keep_owned_receivers")
    kept_local = torch.nonzero(p.owns(unwrap(edge_index)[1])).flatten()
    set_edge_count(ctx, kept_local.numel())
    kept = ShardTensor(kept_local, Rows(0, EDGES), ctx, "keep_owned_receivers")
    out = [edge_index.index_select(1, kept)]
    for v in edge_values:
        out.append(_plain_replicated(v, "keep_owned_receivers").index_select(0, kept))
    return tuple(out)


def local_receivers(p, receivers):
    place = receivers._place if isinstance(receivers, ShardTensor) else None
    if not (isinstance(place, Rows) and place.kind == EDGES and place.values is None):
        raise AtenRefusal(
            f"mlipdd aten dispatch refuses `local_receivers` on {place or 'a plain tensor'}: it maps the receivers "
            "of the kept edges (node numbers) to rows of the owned block. Fix: pass edge_index[1] of what "
            "keep_owned_receivers returned")
    local = receivers._local - p.start if p.start else receivers._local
    return ShardTensor(local, Rows(place.dim, EDGES, values="atoms"), receivers._ctx, "local_receivers")


def owned_rows(p, ctx: HaloContext, x, what: str = "owned_rows"):
    x = _plain_replicated(x, what)
    block = torch.arange(p.start, p.stop, device=x.device)
    return x.index_select(0, ShardTensor(block, Rows(0, OWNED), ctx, what))


def gather_nodes(p, x_owned):
    place = x_owned._place if isinstance(x_owned, ShardTensor) else None
    if not (isinstance(place, Rows) and place.is_atoms() and place.dim == 0 and place.group == 1):
        raise AtenRefusal(
            f"mlipdd aten dispatch refuses `gather_nodes` on {place or 'a plain tensor'}: it gathers this rank's "
            "owned atom rows (rows along dim 0) into the full node set. Fix: pass rows of the owned block "
            "(owned_rows of a full tensor, or what the layers computed from them)")
    return _Gather.apply(x_owned, p)


class _Gather(torch.autograd.Function):
    """Owned rows -> the replicated full tensor; the adjoint keeps the owned block of a
    gradient that is already complete (NOTE [aten graph partition])."""

    @staticmethod
    def forward(ctx, x_owned, p):
        from mlipdd.shard.aten.rules import as_owned
        from mlipdd.shard.graph_partition import gather_rows

        ctx.p, ctx.halo = p, x_owned._ctx
        full = gather_rows(as_owned(x_owned), p)
        return ShardTensor(full, REPLICATE, x_owned._ctx, "gather_nodes")

    @staticmethod
    def backward(ctx, grad_full):
        return owned_rows(ctx.p, ctx.halo, grad_full, "the gradient of gather_nodes"), None


def sum_over_ranks(partial):
    """The identity: a sum over the owned rows is complete and replicated already (the
    rule that reduced the rows all-reduced it); rows themselves are refused."""
    if isinstance(partial, ShardTensor) and not partial._place.is_replicate():
        raise AtenRefusal(
            f"mlipdd aten dispatch refuses `sum_over_ranks` on {partial._place} from `{partial._origin}`: it takes a "
            "per-system sum, and these are rows. Fix: sum the rows first (an index_add by the system index)")
    return partial
