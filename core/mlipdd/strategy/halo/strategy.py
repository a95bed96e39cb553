"""`HaloStrategy`: the model sees ``[owned | ghost]`` rows of the halo planner's plan.

Per forward the ghost rows of positions (and of any extra per-atom float input) are
refreshed from their owners (one all-to-all) and wrapped as ShardTensors of the `Halo`
layout; consolidation sends the ghost partials of gradients home and keeps owned rows.
`SpatialStrategy` is the shared base of strategies built on spatial ownership.
"""

from __future__ import annotations

import contextlib

import torch

from mlipdd.data import NODE_FIELDS, Batch
from mlipdd.shard import ShardMeta, ShardTensor, halo_accumulate
from mlipdd.shard.exchange import pad
from mlipdd.shard.layouts import Halo
from mlipdd.shard.placement import ATOMS, SYSTEM_INDEX, placement_of
from mlipdd.shard.scripted import script_functions_dispatched
from mlipdd.shard.tensor import neighbors_as_edge_rows
from mlipdd.strategy.base import Strategy
from mlipdd.strategy.grid import RankGrid
from mlipdd.strategy.halo.planner import HaloPlanner
from mlipdd.strategy.outputs import consolidate_outputs


class SpatialStrategy(Strategy):
    """A strategy built on spatial ownership: it holds a `HaloPlanner` (subdomains,
    migration, the halo plan) and decides what the model sees of it."""

    spatial = True

    def __init__(self, planner: HaloPlanner):
        self.halo = planner
        self.group = planner.group
        self.state = None  # the subclass's per-rebuild state; None until the first prepare

    @classmethod
    def from_config(cls, config, group=None) -> SpatialStrategy:
        return cls(HaloPlanner.from_config(config, group))

    @property
    def grid(self) -> RankGrid | None:
        return self.halo.grid

    @property
    def rebuilds(self) -> int:
        return self.halo.rebuilds

    @property
    def balance(self):
        return self.halo.balance

    def ghost_rows(self) -> int:
        return 0 if self.state is None else self.state.plan.n_ghost

    def partition(self, full: Batch | None, device=None) -> Batch:
        self.state = None
        return self.halo.partition(full, device)

    def rebuild_due(self, batch: Batch) -> bool:
        return self.halo.needs_rebuild(batch, self.state)


class HaloStrategy(SpatialStrategy):
    """``"halo"``: the model sees ``[owned | ghost]`` rows (module docstring)."""

    name = "halo"
    preset = "SPEC_MPNN_HALO"
    # aten first: the default since issue 21's flip (NOTE [choosing the dispatch]; the same
    # order in sharded and graph partition)
    dispatches = ("aten", "torch_function")
    aten_class = "mlipdd.strategy.aten_halo:AtenHaloStrategy"

    @classmethod
    def accepts(cls, policy) -> bool:
        return policy.is_halo() or policy.is_local()

    def layout(self, policy) -> Halo:
        """Ghost partials of scatters go home unless the policy keeps scatters local (a
        `LocalPolicy` keeps everything on the rank)."""
        return Halo(correct_scatters=not policy.is_local() and policy.scatter == "halo_correction",
                    reduce_systems=policy.system_reductions)

    def prepare(self, batch: Batch, rebuild: bool) -> None:
        self.state = self.halo.prepare(batch, rebuild) or self.state

    def use_spec(self, spec) -> None:
        policy = spec.distribution.policy
        self.halo.ghosts_on_uncut_axes = policy.is_halo() and policy.builds_own_graph

    @contextlib.contextmanager
    def model_scope(self, meta: ShardMeta):
        """Script functions called on rows run under the dispatch (NOTE [scripted functions]
        in mlipdd.shard.scripted); balance="time" times the call."""
        with script_functions_dispatched(), self.halo.balance.timing():
            yield

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, ShardMeta]:
        """The batch the model sees: ``[owned | ghost]`` rows, positions as a ShardTensor."""
        state = self.state
        policy = spec.distribution.policy
        meta = ShardMeta(
            plan=state.plan,
            n_systems=batch.num_systems,
            n_edges=state.neighbors.num_edges,
            layout=self.layout(policy),
            group=self.group,
        )
        positions = batch.positions.detach().requires_grad_(True)
        if state.plan.world_size == 1:
            # NOTE [one rank]: nothing crosses ranks, every handler would be the identity, so
            # the model gets the owned rows themselves, plain tensors, the same objects on
            # every call (a wrapper may cache what it derives from them), and pays no
            # dispatch cost at all.
            node = {"positions": positions, "atomic_numbers": batch.atomic_numbers, "batch": batch.batch,
                    "atom_ids": batch.atom_ids}
            node.update(model_inputs(batch))
            padded = Batch._from_dicts(node, dict(batch.system))
            padded.neighbors = state.neighbors
            padded.n_owned = batch.num_atoms
            return padded, meta
        padded_positions = self.halo.padded_positions(positions, batch.cell, state)
        def wrap(t):
            return ShardTensor.wrap(t, meta, ATOMS)

        node = {
            "positions": wrap(padded_positions),
            "atomic_numbers": wrap(torch.cat([batch.atomic_numbers, state.ghost_numbers])),
            "batch": ShardTensor.wrap(torch.cat([batch.batch, state.ghost_system]), meta, SYSTEM_INDEX),
            "atom_ids": torch.cat([batch.atom_ids, state.ghost_ids]),
        }
        node.update({name: wrap(pad(value, state.plan)) for name, value in model_inputs(batch).items()})
        padded = Batch._from_dicts(node, dict(batch.system))
        padded.neighbors = neighbors_as_edge_rows(state.neighbors, meta)
        padded.n_owned = batch.num_atoms  # for diagnostics; models must not need it
        return padded, meta

    def consolidate(self, outputs: dict, meta: ShardMeta, spec, autograd_outputs) -> dict:
        """Per output: partial sums all-reduced, per-atom rows back to owned rows."""

        checked = meta.layout.is_checked()  # placements are kept (NOTE [refuse by default])
        places = {name: placement_of(value) if checked and getattr(value, "_meta", None) is not None else None
                  for name, value in outputs.items()}

        def per_atom(name, value):
            if value.dim() == 0 or value.shape[0] != meta.n_padded:
                return value  # per system: replicated already
            if name not in spec.owned_only_outputs and _ghosts_hold_partials(name, places[name], autograd_outputs):
                value = halo_accumulate(value, meta.plan)
            return value[: meta.n_owned]

        return consolidate_outputs(outputs, spec, self.group, per_atom)


def _ghosts_hold_partials(name: str, place, autograd_outputs) -> bool:
    """A gradient by atom rows holds each copy's share on its ghost rows, to be summed into
    the owners; a value (or forces the model summed itself with a scatter) holds the
    owners' values there (NOTE [partial rows]). The placement says which; an output
    without one (an unchecked layout) goes by the model's list of autograd outputs."""
    if place is not None and place.kind == "atoms" and place.leads():
        return place.partial
    return name in autograd_outputs


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """Extra per-atom float inputs of the model (partial charges, spins, ...).

    A model reads them at the other end of an edge, so they get ghost rows like the
    positions. State that integrators own (velocities, forces, masses) and integer
    bookkeeping (periodic image counts) never enter the model.
    """
    return {name: value for name, value in batch.node.items()
            if name not in NODE_FIELDS and torch.is_tensor(value) and value.is_floating_point()}
