"""One row of atom rows by its number in one process: ``x[-1]``, ``x[i]``, ``x.select(0, i)``.

# NOTE [a row by its global number]
schnetpack's Atomwise counts its systems with ``int(idx_m[-1]) + 1``: the last atom's
system. In one process row ``i`` of atom rows is the atom whose id is ``i`` (ids are the
one-process row order, `Batch.atom_ids`; ``-1`` is the last of the whole system), and
exactly one rank owns that atom. So the read is exact: every rank agrees on ``i``, the
owner selects its owned row (shares summed first) and broadcasts it; the result is
replicated (one all_reduce of four integers, one broadcast of the row).

Refused, by name and on every rank (the agreement is reduced first):

* ranks that pass different numbers (``x[x.shape[0] - 1]``: a local size, a per-rank
  index), and a non-negative number that equals this rank's row count minus one where
  the whole system's count differs (so ``x[0]`` is refused while some rank holds exactly
  one row) (NOTE [aten counts]: a size of the
  local rows used as a position; a coincidence costs a refusal, never a wrong row);
* rows that carry a gradient: autograd differentiates ``select`` with
  ``select_backward(grad, local sizes, dim, i)``, whose operands are all replicated, so
  it runs on the local tensor (NOTE [aten precedence], step 1) and would put the
  gradient on local row ``i``. A value read for bookkeeping (the system index, atomic
  numbers) carries none;
* edge rows (edges have no order that one process shares) and atom row NUMBERS
  (``values="atoms"``: a local row number means nothing on another rank).

A number past the whole system's rows is torch's IndexError, on every rank.

# NOTE [atom rows kept by a mask]
``z[~known]`` (MACE's and AIMNet2's element checks: which atoms the model has no
parameters for) keeps the atom rows a mask of the same rows selects. One process's result
is those atoms in id order; every rank can have it: each keeps its OWNED rows the mask
selects (a ghost row is another rank's atom), all ranks gather them with their ids, and
sort by id. The result is replicated, the whole system's selection, so a message built
from it (``.tolist()``) is the same on every rank. Rows that carry a gradient are refused
(autograd's ``index_put`` of the gradient into this rank's local rows would need the
selection's layout); so are atom row numbers and edge rows (kept as edges, elsewhere).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mlipdd.comm import collective_device, group_rank, group_size
from mlipdd.shard.aten import comm
from mlipdd.shard.aten.placement import REPLICATE, SHARES
from mlipdd.shard.aten.rules import as_owned, finish, refuse, rows_of, rule, run_local

aten = torch.ops.aten


@rule(aten.select.int)
def select(func, args, kwargs):
    x, dim = args[0], args[1] % args[0].dim()
    p = x._place
    if dim != p.dim:  # another dim: each row keeps its own entry
        d = p.dim - (1 if dim < p.dim else 0)
        return finish(func, args, run_local(func, args, kwargs), p.moved(d), x._ctx)
    return _read_global_row(func, args, kwargs, x, dim, int(args[2]))


def _read_global_row(func, args, kwargs, x, dim, index):
    """NOTE [a row by its global number]."""
    p, ctx = x._place, x._ctx
    if not p.is_atoms():
        refuse(func, args, kwargs, "it reads one edge row by its position (e[i]): edges have no order that one "
               "process shares", "reduce over the edges, or scatter them into atom rows first")
    if p.values == "atoms":
        refuse(func, args, kwargs, "it reads one entry of atom row NUMBERS: a local row number names another atom "
               "on each rank", "read a property the atoms carry instead")
    if x.requires_grad:
        refuse(func, args, kwargs, "it reads one row (x[i]) of rows that carry a gradient: its gradient would land "
               "on this rank's local row i (NOTE [a row by its global number])",
               "read it from a value without a gradient (x.detach()[i]) if it is bookkeeping, or reduce over the "
               "rows (a sum weighted by a mask of the rows)")
    if getattr(ctx, "atom_ids", None) is None:
        refuse(func, args, kwargs, "it reads one row by its number, and this strategy gives no atom ids",
               "give the HaloContext the owned rows' atom_ids")
    n_global = ctx.global_count("atoms") * p.group
    counts = {x.shape[dim], ctx.n_owned * p.group, ctx.n_padded * p.group}
    # x[x.shape[0] - 1]; x[n] is out of range in one process too (a rank with no row: x[0] is fine)
    local_size = index >= 0 and any(index == n - 1 for n in counts if n != n_global)
    flat = index + n_global if index < 0 else index
    row, entry = divmod(flat, p.group)
    owned_ids = ctx.atom_ids[: ctx.n_owned]
    hit = (owned_ids == row).nonzero().flatten() if 0 <= flat < n_global else owned_ids.new_empty(0)
    mine = hit.numel() > 0
    facts = torch.tensor([index, -index, int(local_size), group_rank(ctx.group) if mine else -1],
                         dtype=torch.long, device=collective_device(ctx.group))
    facts = comm.all_reduce(facts, ctx.group, dist.ReduceOp.MAX).tolist()
    if facts[0] != -facts[1]:
        refuse(func, args, kwargs, f"it reads one row by a number that differs between the ranks ({-facts[1]} to "
               f"{facts[0]}): a number computed from this rank's rows (x.shape[0] - 1), not the whole system's",
               "read by a number every rank shares (x[-1] is the whole system's last row)")
    if facts[2]:
        refuse(func, args, kwargs, f"it reads row {index}, which is this rank's (or another rank's) local row count "
               "minus one: a size of the local rows used as a position (one process has "
               f"{n_global // p.group} rows)", "read the last row as x[-1], never as x[x.shape[0] - 1]")
    owner = facts[3]
    if owner < 0:
        raise IndexError(f"index {index} is out of bounds for dimension {dim} with size {n_global} (the whole "
                         f"system's rows, read by `{func}` under the mlipdd aten dispatch)")
    local = as_owned(x) if p.kind == SHARES else x._local
    shape = local.shape[:dim] + local.shape[dim + 1:]
    value = local.select(dim, int(hit[0]) * p.group + entry).contiguous() if mine else local.new_zeros(shape)
    if group_size(ctx.group) > 1:
        value = _broadcast(value, owner, ctx.group)
    return finish(func, args, value, REPLICATE, ctx)


def _broadcast(value: torch.Tensor, owner: int, group) -> torch.Tensor:
    carried = value.to(torch.uint8) if value.dtype == torch.bool else value.clone()
    dist.broadcast(carried, group=group, group_src=owner)
    return carried.to(value.dtype)


@rule(aten.select_backward.default)
def select_backward(func, args, kwargs):
    """The adjoint of a select of another dim than the rows: zeros around the rows' values
    (linear: any kind stays). A select of the rows carries no gradient (the NOTE)."""
    grad, dim = args[0], args[2] % len(args[1])
    p = rows_of(grad)
    d = p.dim + (1 if dim <= p.dim else 0)
    return finish(func, args, run_local(func, args, kwargs), p.moved(d).plain_values(), grad._ctx)


def kept_by_mask(func, args, kwargs, x, mask):
    """NOTE [atom rows kept by a mask]: ``x[mask]`` of atom rows, replicated in id order."""
    p, mp, ctx = x._place, mask._place, x._ctx
    if x.requires_grad or p.values == "atoms" or p.group != 1 or p.dim != 0 or mp.kind == SHARES \
            or getattr(ctx, "atom_ids", None) is None:
        refuse(func, args, kwargs, "it keeps a subset of atom rows (x[mask]) of rows that carry a gradient, of atom "
               "row numbers, or without atom ids: the result is no longer this rank's layout of atoms",
               "multiply by the mask (torch.where(mask, x, 0)) instead of selecting atom rows, or select from "
               "a value without a gradient (x.detach()[mask])")
    n = ctx.n_owned
    local = as_owned(x) if p.kind == SHARES else x._local
    keep = mask._local[:n]
    rows, ids = local[:n][keep], ctx.atom_ids[:n].to(keep.device)[keep]
    if group_size(ctx.group) > 1:
        rows, ids = _gathered(rows, ids, ctx.group)
    order = torch.argsort(ids)
    return finish(func, args, rows[order], REPLICATE, ctx)


def _gathered(rows: torch.Tensor, ids: torch.Tensor, group):
    """Every rank's ``rows`` and ``ids``, concatenated in rank order (padded to one size)."""
    device = collective_device(group)
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(group_size(group))]
    dist.all_gather(sizes, torch.tensor([rows.shape[0]], dtype=torch.long, device=device), group=group)
    sizes = [int(s) for s in sizes]
    longest = max(sizes)
    carried = rows.to(torch.uint8) if rows.dtype == torch.bool else rows
    pad = carried.new_zeros((longest - rows.shape[0], *rows.shape[1:]))
    parts = [carried.new_empty((longest, *rows.shape[1:])) for _ in sizes]
    dist.all_gather(parts, torch.cat([carried, pad]).contiguous(), group=group)
    id_parts = [ids.new_empty(longest) for _ in sizes]
    dist.all_gather(id_parts, torch.cat([ids, ids.new_zeros(longest - ids.shape[0])]), group=group)
    rows = torch.cat([part[:k] for part, k in zip(parts, sizes)]).to(rows.dtype)
    return rows, torch.cat([part[:k] for part, k in zip(id_parts, sizes)])
