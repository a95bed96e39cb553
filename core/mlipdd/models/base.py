"""The model protocol: a wrapper turns a batch into energy, forces and stress.

A wrapper's forward is single-process code. Under domain decomposition the core hands
it a batch whose positions are a `ShardTensor` over ``[owned | ghost]`` rows and whose
neighbour list keeps only edges with an owned receiver; the wrapper does not notice.

Neighbour-list convention (ASE's "ijS"): ``edge_index[0]`` is the sender ``i``,
``edge_index[1]`` the receiver ``j``, and the edge vector is
``positions[j] + shifts - positions[i]``. Messages are scattered into receivers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mlipdd.data import Batch


@dataclass(frozen=True)
class NeighborConfig:
    """The neighbour list a model reads: every pair within ``cutoff``, in both directions
    (a full list in the convention of the module docstring). Under domain decomposition
    each directed edge lives on its receiver's rank, which a half list cannot express."""

    cutoff: float


@dataclass(frozen=True)
class ModelConfig:
    """What a wrapper computes and what it needs.

    ``autograd_outputs`` are derivatives of the energy with respect to positions (forces)
    or strain (stress): under domain decomposition their ghost rows hold partials that
    go back to the owners. The rest come straight out of the forward.
    """

    neighbor_config: NeighborConfig
    outputs: frozenset[str] = frozenset({"energy", "forces", "stress"})
    autograd_outputs: frozenset[str] = frozenset({"forces", "stress"})
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def cutoff(self) -> float:
        return self.neighbor_config.cutoff


def capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``tensor``'s device right now.

    A capture (``DomainConfig(cuda_graph=True)``) refuses every host read of the device
    (``.item()``, ``bool(t)``, boolean-mask indexing): a wrapper skips its input checks and
    host-side filtering then. They still run, on the same inputs, in the eager warm-up
    calls just before the capture (`mlipdd.distributed.cuda_graph`). Also true while
    ``torch.compile`` traces (``DomainConfig(compile=True)``): a host read would break the
    graph; the eager comparison call of the same inputs runs the checks
    (`mlipdd.distributed.compiled`)."""
    if torch.compiler.is_compiling():
        return True
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def per_system_sum(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Sum per-atom ``values`` into one value per system.

    Written as an out-of-place ``scatter_add`` on purpose: under domain decomposition
    the ShardTensor dispatch turns exactly this op into "owned rows + all_reduce".
    """
    out = torch.zeros(batch.num_systems, *values.shape[1:], dtype=values.dtype, device=values.device)
    index = batch.batch.view(-1, *([1] * (values.dim() - 1))).expand_as(values)
    return out.scatter_add(0, index, values)


def strained(batch: Batch, strain: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and cells deformed by the symmetric part of ``strain`` (n_systems, 3, 3)."""
    sym = 0.5 * (strain + strain.transpose(1, 2))
    eye = torch.eye(3, dtype=sym.dtype, device=sym.device)
    deform = eye + sym
    positions = torch.einsum("ni,nij->nj", batch.positions, deform[batch.batch])
    cell = torch.bmm(batch.cell, deform)
    return positions, cell


class ModelWrapper(nn.Module):
    """Base of every model wrapper (the seeds call it BaseModelMixin).

    Two ways to implement one:

    * energy models: implement ``atomic_energies(batch, positions, cell)`` returning one
      energy per atom; the base forward sums them per system and differentiates for
      forces and (via the strain route) stress;
    * self-contained models (MACE computes its own forces): override ``forward``.
    """

    model_config: ModelConfig
    # The strategy `DomainConfig(strategy=None)` (the default) runs this model under on
    # several ranks with its own spec (`mlipdd.distributed.config.resolve_strategy`).
    preferred_strategy: str = "halo"

    @property
    def cutoff(self) -> float:
        return self.model_config.cutoff

    def adapt_input(self, batch: Batch) -> dict:
        """Translate an mlipdd batch into the model's own inputs (default: pass through)."""
        return {"batch": batch}

    def distribution_spec(self, strategy=None):
        """The `MLIPSpec` this model runs under; ``None`` lets the core infer a default."""
        return

    def atomic_energies(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} implements neither atomic_energies nor forward")

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        return energy_forces_stress(self, batch, compute_stress)


def energy_forces_stress(model: ModelWrapper, batch: Batch, compute_stress: bool, sum_systems=None) -> dict:
    """Energy per system, forces by autograd, stress by the strain route.

    ``sum_systems(energies, batch)`` makes the per-system energy (default `per_system_sum`; a
    model whose sums run elsewhere, e.g. inside a compiled graph, passes its own).

    A batch without a neighbour list gets one (on a shallow view, the caller's batch
    is left alone), so ``atomic_energies`` can always read ``batch.neighbors``.
    """
    if batch.neighbors is None:
        from mlipdd.neighbors import attach_neighbors

        batch = _with_positions(batch, batch.positions)
        attach_neighbors(batch, model.cutoff)
    positions = batch.positions
    grad_enabled = torch.is_grad_enabled()
    with torch.enable_grad():
        if not positions.requires_grad:
            positions = positions.detach().requires_grad_(True)
        inputs = [positions]
        cell = batch.cell
        if compute_stress:
            # requires_grad_ after creation: torch.compile cannot trace a factory with requires_grad=True
            strain = torch.zeros_like(batch.cell).requires_grad_(True)
            inputs.append(strain)
            pos_used, cell = strained(_with_positions(batch, positions), strain)
        else:
            pos_used = positions
        energies = model.atomic_energies(batch, pos_used, cell)
        energy = (sum_systems or per_system_sum)(energies, batch)
        # A double-backward graph only for force training (opt-in): MD and inference never need it.
        create_graph = grad_enabled and getattr(model, "force_training", False)
        grads = torch.autograd.grad(energy.sum(), inputs, create_graph=create_graph)
    out = {"energy": energy, "energies": energies, "forces": -grads[0]}
    if compute_stress:
        volume = torch.linalg.det(batch.cell).abs().view(-1, 1, 1)
        out["stress"] = grads[1] / volume
    return out


def _with_positions(batch: Batch, positions: torch.Tensor) -> Batch:
    view = Batch._from_dicts(dict(batch.node), dict(batch.system))
    view.node["positions"] = positions
    return view
