"""`CompiledHaloCall`: ``DomainConfig(compile=True)`` at several ranks under halo storage,
for energy models (a wrapper that implements ``atomic_energies``: LJ and other local
potentials written like it).

Why not compile the eager distributed forward: there the model's rows are ShardTensors,
and dynamo cannot trace their dispatch (wrapping one as a graph input already runs an op
the dispatch refuses, and the handlers issue collectives in Python). So the model runs on
*plain* tensors, this rank's ``[owned | ghost]`` rows, and every collective stays outside
the compiled graph:

    halo exchange (eager, as always) -> compiled on plain rows, padded to caps:
        atom energies, E_rank = sum of the OWNED atoms' energies per system,
        -dE_rank/d(rows) (ghost rows: partial forces), dE_rank/d(strain)
    -> energy all-reduced; ghost partial forces summed into their owners and the stress
       partials all-reduced by the strategy's consolidation, as for the eager outputs.

# NOTE [local energies only]
That equals the eager distributed forward when an owned atom's energy reads only its own
neighbour list (a pair or many-body potential evaluated on the local list): its ghosts
hold their owners' positions, so it sees what one process sees. A model whose energies
read features its neighbours computed (message passing with more than one layer) needs
the ghost rows refreshed between layers, which only the ShardTensor dispatch does. Such
a model is caught, not silently wrong: the first call at every new set of shapes, and
every call whose integer inputs changed (at a rebuild with migration), is also run on
the eager distributed path and compared, on every rank, the decision agreed first; a
difference stops every rank naming compile=False. MACE computes its forces inside its
own forward (it is not an energy model) and is refused at several ranks by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mlipdd.comm import agree_on_errors, any_rank, group_size
from mlipdd.data import Batch
from mlipdd.distributed.compiled import CompiledForceCall, differs_from_eager
from mlipdd.models.base import ModelWrapper, per_system_sum, strained
from mlipdd.shard.tensor import local

__all__ = ["CompiledHaloCall", "is_energy_model"]

OWNED = "_mlipdd_owned"  # a float node field: 1 on owned rows, 0 on ghost rows (float: not an integer input)


def is_energy_model(model) -> bool:
    """Whether the wrapper's forces come from the base class's autograd of ``atomic_energies``."""
    return isinstance(model, ModelWrapper) and type(model).forward is ModelWrapper.forward


class CompiledHaloCall:
    """``call(model_batch, meta, compute_stress, eager_call) -> consolidated outputs``.

    ``model_batch`` is the halo strategy's batch (ShardTensor rows); ``eager_call()`` runs the
    eager distributed forward and consolidation on it (for the checks). Counters as in
    `CompiledForceCall` (``inner``)."""

    def __init__(self, model, strategy, spec, group, reach: float, backend: str, headroom: float):
        self.model = model
        self.strategy = strategy
        self.spec = spec
        self.group = group
        self.inner = CompiledForceCall(self._local_call, None, reach=reach, backend=backend, headroom=headroom,
                                       check_eager=False)

    def __call__(self, model_batch: Batch, meta, compute_stress: bool, eager_call) -> dict:
        plain = plain_rows(model_batch, meta.n_owned)
        outputs = self.inner(plain, compute_stress)
        energy = outputs["energy"].clone()
        if group_size(self.group) > 1:
            dist.all_reduce(energy, group=self.group)
        outputs["energy"] = energy
        autograd_outputs = getattr(self.model.model_config, "autograd_outputs", frozenset())
        result = self.strategy.consolidate(outputs, meta, self.spec, autograd_outputs)
        if any_rank(self.inner.needs_check, self.group):  # every rank runs the eager path, or none
            self.inner.checks += 1
            agree_on_errors(differs_from_eager(result, eager_call(), self.inner.caps), self.group)
        return result

    def _local_call(self, batch: Batch, compute_stress: bool) -> dict:
        """This rank's share (NOTE [local energies only]); plain tensors, no collective."""
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
            energy = per_system_sum(energies * batch.node[OWNED], batch)
            grads = torch.autograd.grad(energy.sum(), inputs)
        out = {"energy": energy, "energies": energies, "forces": -grads[0]}
        if compute_stress:
            out["stress"] = grads[1] / torch.linalg.det(batch.cell).abs().view(-1, 1, 1)
        return out


def plain_rows(model_batch: Batch, n_owned: int) -> Batch:
    """The halo batch's rows as plain tensors (same data), with the owned-row marker."""
    node = {name: local(value) if torch.is_tensor(value) else value for name, value in model_batch.node.items()}
    node["positions"] = node["positions"].detach()
    rows = node["positions"].shape[0]
    owned = torch.zeros(rows, dtype=node["positions"].dtype, device=node["positions"].device)
    owned[:n_owned] = 1.0
    node[OWNED] = owned
    system = {name: local(value) if torch.is_tensor(value) else value for name, value in model_batch.system.items()}
    plain = Batch._from_dicts(node, system)
    neighbors = model_batch.neighbors
    plain.neighbors = type(neighbors)(local(neighbors.edge_index), local(neighbors.unit_shifts), neighbors.cutoff,
                                      neighbors.full_list)
    return plain
