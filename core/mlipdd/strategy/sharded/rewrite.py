"""The sharded rewrite of a halo plan: the same neighbour list over ``[owned | request
table]`` (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlipdd.data import Batch, InputError
from mlipdd.neighbors import NeighborList
from mlipdd.shard.exchange import ExchangePlan, all_to_all_rows
from mlipdd.strategy.halo import HaloState, exchange_counts


@dataclass
class ShardedState:
    """Everything fixed between two rebuilds (field names shared with `HaloState`)."""

    plan: ExchangePlan  # the request table: its ghost rows are the remote atoms read
    remote_ids: torch.Tensor  # atom id of each request-table row
    neighbors: NeighborList  # receivers owned; senders index [owned | request table]
    reference_padded: torch.Tensor  # owned positions at build time (for the skin check)
    reference_cell: torch.Tensor
    atom_ids: torch.Tensor
    halo_ghosts: int  # ghost rows halo storage would keep here (for memory reports)


def shard_halo(halo: HaloState, batch: Batch, rank: int, group) -> ShardedState:
    """Rewrite the halo's neighbour list over ``[owned | request table]`` (module docstring)."""
    n = batch.num_atoms
    neighbors = halo.neighbors
    sender, receiver = neighbors.edge_index[0], neighbors.edge_index[1]
    unit_shifts = neighbors.unit_shifts.clone()
    world = halo.plan.world_size
    device = sender.device

    ghost = sender >= n
    k = sender[ghost] - n
    recv_counts = torch.tensor(halo.plan.recv_counts, device=device)
    ghost_owner = torch.repeat_interleave(torch.arange(world, device=device), recv_counts)[k]
    ghost_id = halo.ghost_ids[k]
    # the ghost sat at owner + u @ cell; the edge now reads the owner and shifts by -u
    unit_shifts[ghost] = unit_shifts[ghost] - halo.ghost_unit_shift[k].to(unit_shifts.dtype)

    new_sender = sender.clone()
    mine = ghost_owner == rank  # an image of one of this rank's own atoms (small cells)
    ghost_rows = torch.empty_like(k)
    ghost_rows[mine] = rows_of_ids(batch.atom_ids, ghost_id[mine], "own image")

    # one request-table row per remote atom, grouped by owner then id
    remote_owner, remote_id = ghost_owner[~mine], ghost_id[~mine]
    span = int(batch.atom_ids.max()) + 1 if n else 1
    span = max(span, int(remote_id.max()) + 1 if remote_id.numel() else 1)
    keys, slot = torch.unique(remote_owner * span + remote_id, return_inverse=True)
    table_owner, table_id = keys // span, keys % span
    ghost_rows[~mine] = n + slot
    new_sender[ghost] = ghost_rows

    # tell each owner which of its rows this rank reads
    asked = torch.bincount(table_owner, minlength=world)
    asked_of_me = exchange_counts(asked, group)
    wanted_ids = all_to_all_rows(table_id, asked.tolist(), asked_of_me, group)
    send_index = rows_of_ids(batch.atom_ids, wanted_ids, "requested")
    plan = ExchangePlan(
        send_index=send_index,
        send_counts=tuple(asked_of_me),
        recv_counts=tuple(asked.tolist()),
        n_owned=n,
        group=group,
    )
    sharded_list = NeighborList(
        torch.stack([new_sender, receiver]),
        unit_shifts,
        neighbors.cutoff,
        neighbors.full_list,
    )
    return ShardedState(
        plan=plan,
        remote_ids=table_id,
        neighbors=sharded_list,
        reference_padded=halo.reference_padded[:n].clone(),
        reference_cell=halo.reference_cell,
        atom_ids=halo.atom_ids,
        halo_ghosts=halo.plan.n_ghost,
    )


def rows_of_ids(atom_ids: torch.Tensor, wanted: torch.Tensor, what: str) -> torch.Tensor:
    """Rows of ``wanted`` ids among this rank's owned ``atom_ids``."""
    if wanted.numel() == 0:
        return wanted.new_zeros(0)
    order = torch.argsort(atom_ids)
    sorted_ids = atom_ids[order]
    where = torch.searchsorted(sorted_ids, wanted).clamp_max(max(len(sorted_ids) - 1, 0))
    if len(sorted_ids) == 0 or not torch.equal(sorted_ids[where], wanted):
        raise InputError(
            f"{what} atom ids are not owned by the rank asked for them; atom ids must be unique "
            "across ranks (partition the system with DistributedModel.partition)"
        )
    return order[where]
