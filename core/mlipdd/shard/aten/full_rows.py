"""``GatherInputsFull`` / ``SliceOutputsOwned`` under the aten dispatch: every atom on every rank.

# NOTE [aten full rows]
An op adapted with ``GatherInputsFull`` reads the whole system (a per-system mix, a
dense solve over all atoms). Each rank sends its owned rows to every rank (one
all_to_all, uneven counts) and puts them in global atom-id order, so every rank runs the
op on the SAME values and gets the global result: an output of one row per atom of the
batch is cut to this rank's rows (``SliceOutputsOwned``: owned + ghost, each ghost its
atom's value), any other output is the same value on every rank (replicated).

Backward: the op's formula needs the global gradient of its outputs. A sliced output's
gradient is this rank's shares by row; placed by atom id and summed over ranks it is the
global gradient, the same on every rank. The formula then gives every rank the same
global input gradients: each rank keeps its owned atoms' rows (their whole gradient,
ghost shares zero), and a replicated input's gradient is already the total (summing it
over ranks would count it once per rank).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from mlipdd.shard.aten import comm
from mlipdd.shard.aten.tensor import AtenRefusal
from mlipdd.shard.custom_ops import _all_gather_rows, _gather_counts, active_row_ids


class FullRows:
    """Where this rank's rows sit among the batch's atoms (collective once per forward)."""

    def __init__(self, ctx):
        row_ids = active_row_ids()
        if row_ids is None or row_ids.shape[0] != ctx.n_padded:
            raise AtenRefusal(
                "GatherInputsFull needs the global atom id of each of this rank's rows; Fix: activate the "
                "adapters with mlipdd.shard.custom_ops.activated(spec, row_ids=model_batch.atom_ids) "
                "(DistributedModel does this)")
        self.ctx, self.row_ids = ctx, row_ids
        with _disable_current_modes():  # plain bookkeeping: no factory makes a ShardTensor here
            owned_ids = row_ids[: ctx.n_owned]
            self.counts = _gather_counts(ctx.n_owned, owned_ids.device, ctx.group)
            all_ids = _all_gather_rows(owned_ids, self.counts, ctx.group)
            self.n_global = all_ids.shape[0]
            if not torch.equal(all_ids.sort().values, torch.arange(self.n_global, device=all_ids.device)):
                raise AtenRefusal(
                    "GatherInputsFull: the ranks' atom ids are not 0..N-1 exactly once; Fix: keep the ids "
                    "Batch.from_data_list assigns (do not renumber atom_ids)")
            # all_ids[k] is the atom at gathered row k; its inverse puts the rows in id order
            self.order = torch.empty_like(all_ids).index_copy_(
                0, all_ids, torch.arange(self.n_global, device=all_ids.device))

    @classmethod
    def of(cls, ctx) -> FullRows:
        if "full_rows" not in ctx._global:
            ctx._global["full_rows"] = cls(ctx)
        return ctx._global["full_rows"]

    def gather(self, owned: torch.Tensor) -> torch.Tensor:
        """This rank's owned rows -> every atom's row, in id order, on every rank."""
        with _disable_current_modes():
            return _all_gather_rows(owned.contiguous(), self.counts, self.ctx.group).index_select(0, self.order)

    def slice(self, every: torch.Tensor) -> torch.Tensor:
        """One row per atom of the batch -> this rank's rows (owned + ghost)."""
        return every.index_select(0, self.row_ids)

    def global_gradient(self, shares: torch.Tensor) -> torch.Tensor:
        """This rank's shares by row -> the gradient of every atom's row (the same on every rank)."""
        with _disable_current_modes():
            placed = shares.new_zeros((self.n_global, *shares.shape[1:])).index_add_(0, self.row_ids, shares)
            return comm.all_reduce(placed, self.ctx.group)

    def owned_part(self, every: torch.Tensor) -> torch.Tensor:
        """A global gradient -> this rank's owned rows of it, ghost rows zero (SHARES)."""
        with _disable_current_modes():
            owned = every.index_select(0, self.row_ids[: self.ctx.n_owned])
            ghosts = every.new_zeros((self.ctx.n_padded - self.ctx.n_owned, *every.shape[1:]))
            return torch.cat([owned, ghosts])
