"""`CompiledHaloCall`: ``DomainConfig(compile=True)`` at several ranks under halo (and
sharded) storage, for models whose energy is a sum of per-atom energies (a wrapper that
implements ``atomic_energies``: LJ, `ToyMPNN`, and MACE through its compile hook), and for
wrappers whose own forward sums per system through `system_sum` (AIMNet2: NOTE [own
forward on rows]).

Why not compile the eager distributed forward: there the model's rows are ShardTensors,
and dynamo cannot trace their dispatch (wrapping one as a graph input already runs an op
the dispatch refuses, and the rules issue collectives in Python). So the model runs on
*plain* tensors, this rank's ``[owned | ghost]`` rows, and every collective stays outside
the compiled graph:

    halo exchange (eager, as always) -> compiled on plain rows, padded to caps:
        atom energies, E_rank = sum of the OWNED atoms' energies per system,
        -dE_rank/d(rows) (ghost rows: partial forces), dE_rank/d(strain)
    -> energy all-reduced; ghost partial forces summed into their owners and the stress
       partials all-reduced by the strategy's consolidation, as for the eager outputs.

# NOTE [deep ghost shell]
An owned atom's energy after ``L`` message-passing layers reads every atom within ``L``
hops of it (each hop shorter than the cutoff), and reads correct features only if every
atom within ``L - 1`` hops saw its whole neighbourhood. The eager distributed forward
gets that by refreshing ghost rows between layers (the ShardTensor dispatch). Compiled,
nothing is exchanged inside the forward; instead the shell is deep enough that no
exchange is needed: ghosts reach ``L * cutoff + skin`` (every atom ``L`` hops away now
was within that of its owned atom's subdomain at the last rebuild, each having moved at
most ``skin / 2``), and the list the compiled call reads is built over ALL local rows,
keeping the edges whose receiver is within ``L - 1`` hops of an owned atom in the list
(the list reaches ``cutoff + skin``, so its hops include every hop that is shorter than
the cutoff until the next rebuild). Rows farther out get wrong features, which no owned
energy reads; only owned energies are summed. Exact for any model that reads at most
``L`` hops, where ``L`` is what it declares as ``message_passing_layers`` (an energy
model that declares nothing counts as local, one hop: a pair or many-body potential on
its own list). The price: more ghost rows (the shell is ``L`` cutoffs deep, not one)
and the edges among them, computed on every rank; nothing is exchanged per layer.

Other ways were weighed (issue 22): a halo exchange inside the compiled graph through
``torch.distributed._functional_collectives`` traces and differentiates on gloo
(``all_to_all_single_autograd`` under ``aot_eager``: equal to eager), but it must be
called where the model refreshes rows, which only the model's own code knows (every
wrapper would be rewritten around its layers); per-layer compiled regions need the same
surgery. The deep shell needs from the model one number.

# NOTE [caught, not silently wrong]
A model that reads more hops than it declares (or, undeclared, more than its own list) is
caught: the first call at every new set of shapes, and every call whose integer inputs
changed, is also run on the eager distributed path and compared, on every rank, the
decision agreed first; a difference stops every rank naming compile=False and
``message_passing_layers``. A wrapper with its own forward and neither ``atomic_energies``
nor ``system_sums_over_ranks`` (UMA: use graph partition) is refused at several ranks by name.

# NOTE [own forward on rows]
A wrapper whose own forward sums per system only through
`mlipdd.distributed.compiled_sums.system_sum` (it declares ``system_sums_over_ranks``:
AIMNet2, whose charge equilibration sums each system's charges in every pass) runs that
forward here, on the plain rows with the owned-row marker: its sums count the owned rows
and are completed over ranks inside the graph, so its energy is the replicated total and
its derivatives ``world_size`` times this rank's share (NOTE [replicated seed] there).
Hops of different lengths (a 5 A network under a 15 A Coulomb sum) are declared as
``receptive_hop_lengths``, nearest first: the shell is their sum + skin, and the receivers
kept are those reached through all hops but the last, hop ``k`` along edges up to
``length_k + skin`` long at the rebuild.

# NOTE [sharded, compiled]
Under sharded storage the eager forward keeps owned rows only and routes each read of a
remote row to its owner, per op, through the ShardTensor dispatch, which dynamo cannot
trace. Compiled, the sharded strategy's own halo plan (the one its request table is
rewritten from, deepened as above) hands the compiled region plain ``[owned | ghost]``
rows for the duration of the call (`HaloRows`): the per-atom state between calls is
owned rows, as in the eager run (the halo plan, its ghost ids and list, is kept beside
the sharded one); inside the call the ghost shell is materialised once, as halo storage
does, instead of the per-op request tables. The checks compare with the
eager SHARDED forward (routed reads), so what is compared is the storage the user chose.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from mlipdd.comm import agree_on_errors, any_rank, group_size
from mlipdd.data import Batch, InputError
from mlipdd.distributed.compiled import CompiledForceCall, differs_from_eager
from mlipdd.distributed.compiled_sums import OWNED_ROWS, RANKS, summing_over_ranks
from mlipdd.models.base import ModelWrapper, per_system_sum, strained
from mlipdd.neighbors import NeighborList, build_neighbor_list
from mlipdd.shard.exchange import halo_accumulate, pad
from mlipdd.strategy.halo import HaloStrategy, model_inputs
from mlipdd.strategy.outputs import consolidate_outputs

__all__ = ["CompiledHaloCall", "HaloRows", "compiled_on_ranks", "is_energy_model", "receptive_hops",
           "refusal_on_ranks"]


def is_energy_model(model) -> bool:
    """Whether the wrapper's forces come from the base class's autograd of ``atomic_energies``."""
    return isinstance(model, ModelWrapper) and type(model).forward is ModelWrapper.forward


def has_atomic_energies(model) -> bool:
    """Whether the wrapper implements ``atomic_energies`` itself (an energy model, or a wrapper
    with its own forward that also offers its per-atom energies as a compile hook)."""
    return isinstance(model, ModelWrapper) and type(model).atomic_energies is not ModelWrapper.atomic_energies


def sums_over_ranks(model) -> bool:
    """Whether the wrapper's own forward runs compiled at several ranks: every per-system sum
    in it goes through `mlipdd.distributed.compiled_sums.system_sum` (NOTE [replicated seed])."""
    return not is_energy_model(model) and bool(getattr(model, "system_sums_over_ranks", False))


def receptive_hops(model) -> int:
    """How many neighbour-list hops an atom's energy reads (NOTE [deep ghost shell]): the
    wrapper's ``message_passing_layers``, else 1 (a local energy model)."""
    declared = getattr(model, "message_passing_layers", None)
    return 1 if declared is None else int(declared)


def hop_lengths(model, cutoff: float) -> tuple[float, ...]:
    """The hops an owned atom's energy reads, nearest first (NOTE [deep ghost shell]): the
    wrapper's ``receptive_hop_lengths`` (A), else ``receptive_hops`` hops of ``cutoff``."""
    declared = getattr(model, "receptive_hop_lengths", None)
    if declared is not None:
        return tuple(float(h) for h in declared)
    return (float(cutoff),) * receptive_hops(model)


def refusal_on_ranks(model, world_size: int) -> InputError | None:
    """Why ``model`` cannot be compiled at several ranks, or None."""
    name = type(model).__name__
    if not (has_atomic_energies(model) or sums_over_ranks(model)):
        return InputError(
            f"DomainConfig(compile=True) on {world_size} ranks compiles models whose energy is a sum of "
            f"per-atom energies (atomic_energies) on each rank's plain rows, or whose own forward sums per "
            f"system only through mlipdd.distributed.compiled_sums.system_sum (system_sums_over_ranks); "
            f"{name} computes its energy and forces in its own forward only, and its distributed rows are "
            "ShardTensors, whose dispatch torch.compile cannot trace. Compile it at ONE rank, or leave "
            "compile=False with several ranks (the eager distributed path)"
        )
    declares = any(getattr(model, attr, None) is not None
                   for attr in ("message_passing_layers", "receptive_hop_lengths"))
    if not is_energy_model(model) and not declares:
        return InputError(
            f"DomainConfig(compile=True) on {world_size} ranks: {name} has its own forward and "
            "does not declare message_passing_layers (how many neighbour hops its energies read, "
            "which sets the ghost shell: mlipdd.distributed.compiled_halo NOTE [deep ghost shell]); "
            "declare it on the wrapper, compile at ONE rank, or leave compile=False"
        )
    hops = hop_lengths(model, 1.0)
    if not hops or min(hops) <= 0:
        return InputError(f"{name}: the hops its energies read must be a positive number of positive "
                          f"lengths (message_passing_layers / receptive_hop_lengths), got {hops}")
    return None


class HaloRows:
    """The plain ``[owned | ghost]`` rows of a spatial strategy's halo plan, and their
    consolidation: what the compiled region reads and returns (no ShardTensor, so the dispatch
    does not run here; the eager checks run the strategy's own). A halo strategy's plan is
    its own state; a sharded one keeps the halo plan its request table is rewritten from
    (NOTE [sharded, compiled])."""

    def __init__(self, strategy):
        if isinstance(strategy, HaloStrategy):
            self._state = "state"
        elif hasattr(strategy, "keep_halo_state"):
            strategy.keep_halo_state = True
            self._state = "halo_state"
        else:
            raise InputError(
                f"DomainConfig(compile=True) on several ranks compiles halo and sharded storage (plain rows with "
                f"a deep ghost shell) and graph partition; not the {strategy.name} strategy: leave compile=False")
        self.strategy = strategy
        self.sharded = self._state == "halo_state"

    @property
    def state(self):
        return getattr(self.strategy, self._state)

    def rows(self, batch: Batch) -> Batch:
        """This rank's rows as plain tensors, ghost rows refreshed from their owners (one
        exchange), with the owned-row marker (`OWNED_ROWS`) and the plan's list."""
        state = self.state
        positions = batch.positions.detach()
        node = {"positions": positions, "atomic_numbers": batch.atomic_numbers, "batch": batch.batch,
                "atom_ids": batch.atom_ids, **model_inputs(batch)}
        if state.plan.world_size > 1:
            node.update({
                "positions": self.strategy.halo.padded_positions(positions, batch.cell, state),
                "atomic_numbers": torch.cat([batch.atomic_numbers, state.ghost_numbers]),
                "batch": torch.cat([batch.batch, state.ghost_system]),
                "atom_ids": torch.cat([batch.atom_ids, state.ghost_ids]),
            })
            node.update({name: pad(value, state.plan) for name, value in model_inputs(batch).items()})
        owned = torch.zeros(state.plan.n_padded, dtype=positions.dtype, device=positions.device)
        owned[: state.plan.n_owned] = 1.0
        node[OWNED_ROWS] = owned
        plain = Batch._from_dicts(node, dict(batch.system))
        plain.neighbors, plain.n_owned = state.neighbors, batch.num_atoms
        return plain

    def consolidate(self, outputs: dict, spec, autograd_outputs) -> dict:
        """As halo storage's: a gradient's ghost rows (partials) summed into their owners, the
        owned rows kept; the spec's per-rank partials (the strain stress) summed over ranks."""
        plan = self.state.plan

        def per_atom(name, value):
            if value.dim() == 0 or value.shape[0] != plan.n_padded:
                return value  # per system: replicated already
            if name not in spec.owned_only_outputs and name in autograd_outputs:
                value = halo_accumulate(value, plan)
            return value[: plan.n_owned]

        return consolidate_outputs(outputs, spec, self.strategy.group, per_atom)


def compiled_on_ranks(model, strategy, spec, group, config, **options) -> CompiledHaloCall:
    """The compiled call of a `DistributedModel` at several ranks, its halo deepened to the
    model's hops (NOTE [deep ghost shell]); built before the first partition, so that the
    rank grid is chosen for that width too. Raises `refusal_on_ranks`'s error."""
    refusal = refusal_on_ranks(model, strategy.world_size)
    if refusal is not None:
        raise refusal
    hops = hop_lengths(model, config.cutoff)
    if hops != (config.cutoff,):
        strategy.halo.width = max(sum(hops), config.cutoff) + config.skin
    return CompiledHaloCall(model, HaloRows(strategy), spec, group, hops=hops, skin=config.skin, **options)


class CompiledHaloCall:
    """``call(batch, compute_stress, eager_call) -> consolidated outputs``.

    ``batch``: this rank's owned atoms, prepared (`HaloRows` makes the plain rows of it);
    ``eager_call()`` runs the strategy's eager distributed forward and consolidation (for the
    checks); ``installing(rows)`` is entered around the compiled call only (the spec's adapters;
    the eager call installs its own). Counters: `CompileCounts` (``inner``). ``hops``: the layers an energy reads (NOTE [deep ghost
    shell]); with more than one, the strategy's shell must have been deepened (`deepen_halo`)."""

    def __init__(self, model, rows: HaloRows, spec, group, reach: float, backend: str, headroom: float,
                 hops: tuple[float, ...] = (), skin: float = 0.0):
        self.model = model
        self.rows = rows
        self.strategy = rows.strategy
        self.spec = spec
        self.group = group
        self.hops = tuple(hops)
        self.skin = float(skin)
        self.list_cutoff = float(reach)
        self.own_forward = sums_over_ranks(model)  # NOTE [replicated seed] in compiled_sums
        self._receptive: tuple[int, NeighborList] | None = None  # (rebuild it was built at, list)
        local_call = self._forward_call if self.own_forward else self._local_call
        self.inner = CompiledForceCall(local_call, None, reach=reach, backend=backend, headroom=headroom,
                                       check_eager=False)

    def __call__(self, batch: Batch, compute_stress: bool, eager_call,
                 installing=lambda rows: contextlib.nullcontext()) -> dict:
        plain = self.last_rows = self.rows.rows(batch)
        if len(self.hops) > 1:
            plain.neighbors = self._receptive_list(plain, batch.num_atoms)
        with installing(plain), summing_over_ranks(self.group):  # the spec's adapters, entered by the caller
            outputs = self.inner(plain, compute_stress)
        if not self.own_forward:  # this rank's owned share; its own forward's is the total already
            energy = outputs["energy"].clone()
            if group_size(self.group) > 1:
                dist.all_reduce(energy, group=self.group)
            outputs["energy"] = energy
        autograd_outputs = getattr(self.model.model_config, "autograd_outputs", frozenset())
        result = self.rows.consolidate(outputs, self.spec, autograd_outputs)
        if any_rank(self.inner.needs_check, self.group):  # every rank runs the eager path, or none
            self.inner.checks += 1
            agree_on_errors(_named(differs_from_eager(result, eager_call(), self.inner.caps)), self.group)
        return result

    def _receptive_list(self, plain: Batch, n_owned: int) -> NeighborList:
        """The list over all rows, built at the first call after each rebuild (the rows then
        sit where the rebuild put them, as the strategy's own list was built)."""
        rebuild = self.strategy.rebuilds
        if self._receptive is None or self._receptive[0] != rebuild:
            grid = self.strategy.grid
            cut = torch.tensor([g > 1 or self.strategy.halo.ghosts_on_uncut_axes for g in grid.dims],
                               device=plain.positions.device)
            self._receptive = (rebuild, receptive_neighbors(plain, n_owned, self.list_cutoff, cut,
                                                            [h + self.skin for h in self.hops]))
        return self._receptive[1]

    def _local_call(self, batch: Batch, compute_stress: bool) -> dict:
        """This rank's share (NOTE [deep ghost shell]); plain tensors, no collective."""
        positions = batch.positions
        with torch.enable_grad():
            inputs = [positions]
            cell = batch.cell
            if compute_stress:
                strain = torch.zeros_like(cell).requires_grad_(True)
                inputs.append(strain)
                view = Batch._from_dicts(dict(batch.node), dict(batch.system))
                view.neighbors = batch.neighbors
                used, cell = strained(view, strain)
            else:
                used = positions
            energies = self.model.atomic_energies(batch, used, cell)
            energy = per_system_sum(energies * batch.node[OWNED_ROWS], batch)
            grads = torch.autograd.grad(energy.sum(), inputs)
        out = {"energy": energy, "energies": energies, "forces": -grads[0]}
        if compute_stress:
            out["stress"] = grads[1] / torch.linalg.det(batch.cell).abs().view(-1, 1, 1)
        return out

    def _forward_call(self, batch: Batch, compute_stress: bool) -> dict:
        """The wrapper's own forward on this rank's rows, its per-system sums over ranks in
        the graph; its derivatives are ``world_size`` times this rank's share (NOTE
        [replicated seed] in mlipdd.distributed.compiled_sums)."""
        out = dict(self.model(batch, compute_stress=compute_stress))
        share = 1.0 / RANKS.size
        for name in getattr(self.model.model_config, "autograd_outputs", ()):
            if name in out:
                out[name] = out[name] * share
        return out


def _named(error: RuntimeError | None) -> RuntimeError | None:
    if error is None:
        return None
    return RuntimeError(f"{error} (at several ranks a model whose energies read more neighbour hops than its "
                        "message_passing_layers says: NOTE [deep ghost shell] in mlipdd.distributed.compiled_halo)")


def receptive_neighbors(plain: Batch, n_owned: int, cutoff: float, cut_axes: torch.Tensor, hops) -> NeighborList:
    """Edges over all ``[owned | ghost]`` rows whose receiver is reached from an owned row
    through the first ``len(hops) - 1`` hops, hop ``k`` along edges up to ``hops[k]`` long
    (NOTE [deep ghost shell]); open along the cut axes (ghosts stand in for the neighbours
    there), periodic along the others, as the strategy's own list."""
    positions = plain.positions.detach()
    wrap = plain.pbc & ~cut_axes
    view = Batch._from_dicts(
        {"positions": positions, "batch": plain.batch, "atom_ids": torch.arange(positions.shape[0])},
        {"cell": torch.where(wrap[..., None], plain.cell.detach(), torch.zeros_like(plain.cell)), "pbc": wrap},
    )
    neighbors = build_neighbor_list(view, cutoff)
    needed = torch.zeros(positions.shape[0], dtype=torch.bool, device=positions.device)
    needed[:n_owned] = True
    cell = view.cell[plain.batch[neighbors.receivers]]
    shifts = torch.einsum("ei,eij->ej", neighbors.unit_shifts.to(positions.dtype), cell)
    lengths = (positions[neighbors.receivers] + shifts - positions[neighbors.senders]).norm(dim=1)
    for longest in hops[:-1]:  # a receiver's senders are one hop farther out
        along = needed[neighbors.receivers] & (lengths <= longest)
        needed[neighbors.senders[along]] = True
    kept = neighbors.select(needed[neighbors.receivers])
    return NeighborList(kept.edge_index, kept.unit_shifts, cutoff, kept.full_list)
