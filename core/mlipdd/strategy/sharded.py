"""Sharded storage: the halo strategy's ownership, without storing the ghost shell.

Ownership, partition and migration are the spatial ones of the halo strategy: this
strategy composes a `HaloPlanner` (its public interface only). At each rebuild the
halo's neighbour list (built over ``[owned | ghost]`` positions, as for
halo storage) is rewritten so that it no longer needs ghost rows:

* a ghost sender is an image of some atom: (owner rank, atom id, unit shift ``u``),
  its position ``x_owner + u @ cell``. The edge keeps the atom and carries the shift
  instead: ``x_j + (-u) @ cell - x_owner`` is the same vector, so a model that reads
  ``positions[receiver] + shifts - positions[sender]`` (the library's convention) sees
  one process's geometry;
* the atom becomes an owned row (an image of an atom this rank owns) or a row of the
  request table, one per remote atom read, grouped by owner (`ExchangePlan`);
* the owners learn which of their rows to send (one ``all_to_all`` of ids).

The model then gets a batch of owned rows (ShardTensors with a `ShardMeta`), whose
reads of remote rows are routed to the owners by the dispatch
(`mlipdd.shard.sharded_handlers`). Per-atom outputs are already owned rows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mlipdd.data import Batch, InputError
from mlipdd.neighbors import NeighborList
from mlipdd.shard import ShardMeta, ShardTensor
from mlipdd.shard.exchange import ExchangePlan, all_to_all_rows
from mlipdd.shard.layouts import Sharded
from mlipdd.shard.owned_rows import owned_rows_scope
from mlipdd.shard.placement import ATOMS, SYSTEM_INDEX
from mlipdd.shard.scripted import script_functions_dispatched
from mlipdd.shard.tensor import neighbors_as_edge_rows
from mlipdd.strategy.halo import HaloState, SpatialStrategy, exchange_counts, model_inputs
from mlipdd.strategy.outputs import consolidate_outputs


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


class ShardedStrategy(SpatialStrategy):
    """``"sharded"``: owned rows only; remote reads routed to their owners."""

    name = "sharded"
    preset = "SPEC_MPNN_SHARDED"

    @classmethod
    def accepts(cls, policy) -> bool:
        # "halo | sharded -> sharded": a halo model's reads are served over the wire; one
        # that builds its own graph over the ghost shell (NOTE [own graph]) needs the rows
        return policy.is_sharded() or (policy.is_halo() and not policy.builds_own_graph)

    def layout(self, policy) -> Sharded:
        """A sharded policy says which of reads and scatters are routed; a halo policy
        ("halo | sharded -> sharded") has both routed."""
        if policy.is_sharded():
            return Sharded(route_gathers=policy.gather == "distributed",
                           route_scatters=policy.scatter == "distributed",
                           reduce_systems=policy.system_reductions)
        return Sharded(reduce_systems=policy.system_reductions)

    def prepare(self, batch: Batch, rebuild: bool) -> None:
        """Collective: when the halo plan is rebuilt, rewrite it over owned rows."""
        halo = self.halo.prepare(batch, rebuild)
        if halo is not None:
            self.state = shard_halo(halo, batch, self.rank, self.group)

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, ShardMeta]:
        """Owned rows only; positions and atomic numbers as sharded ShardTensors."""
        state = self.state
        meta = ShardMeta(
            plan=state.plan,
            n_systems=batch.num_systems,
            n_edges=state.neighbors.num_edges,
            layout=self.layout(spec.distribution.policy),
            group=self.group,
        )
        # the ShardTensor itself is the leaf: wrapping a leaf under no_grad (dynamics) would
        # give an alias outside the graph, which autograd.grad could not differentiate by
        positions = ShardTensor.wrap(batch.positions.detach(), meta, ATOMS).requires_grad_(True)
        node = {
            "positions": positions,
            "atomic_numbers": ShardTensor.wrap(batch.atomic_numbers, meta, ATOMS),
            "batch": ShardTensor.wrap(batch.batch, meta, SYSTEM_INDEX),
            "atom_ids": batch.atom_ids,
        }
        # extra per-atom inputs (partial charges, spins) as halo storage hands them over,
        # owned rows here: a read at an edge's remote end is routed like the positions'
        node.update({name: ShardTensor.wrap(value, meta, ATOMS) for name, value in model_inputs(batch).items()})
        owned = Batch._from_dicts(node, dict(batch.system))
        owned.neighbors = neighbors_as_edge_rows(state.neighbors, meta)
        owned.n_owned = batch.num_atoms
        return owned, meta

    @contextlib.contextmanager
    def model_scope(self, meta: ShardMeta):
        """Per-atom tensors the model creates from the atom count are owned rows too
        (NOTE [row counts] in mlipdd.shard.owned_rows), script functions called on rows run
        under the dispatch (NOTE [scripted functions] in mlipdd.shard.scripted);
        balance="time" times the call."""
        with owned_rows_scope(meta), script_functions_dispatched(), self.halo.balance.timing():
            yield

    def consolidate(self, outputs: dict, meta: ShardMeta, spec, autograd_outputs) -> dict:
        """Per-atom outputs are owned rows already (gradients reached their owners in the
        routed gathers' backward); rank partials named by the spec are summed."""
        return consolidate_outputs(outputs, spec, self.group)

    def stored_rows(self) -> dict[str, int]:
        """Rows of one per-atom tensor on this rank, sharded vs halo storage."""
        state = self.state
        return {
            "owned": state.plan.n_owned,
            "request_table": state.plan.n_ghost,  # transient: only inside a routed gather
            "halo_ghosts": state.halo_ghosts,
        }

    def report(self) -> dict:
        return {**super().report(), **({} if self.state is None else {"stored_rows": self.stored_rows()})}


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
