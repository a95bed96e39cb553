"""Bring your own model: a plain-torch MPNN, validated, then run under domain decomposition.

    torchrun --nproc_per_node 2 examples/04_byo_pytorch_mpnn.py
    python examples/04_byo_pytorch_mpnn.py            # one process: validates, then runs on 1 rank

The wrapper below is ordinary single-process code (three message-passing layers,
autograd forces). mlipdd needs nothing else from it: `trace_and_validate` checks it on
spawned ranks against one process and returns the spec to ship with the model.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch
from mlipdd import Batch
from mlipdd.distributed import DistributedManager, DistributedModel, DomainConfig
from mlipdd.lattices import fcc_argon
from mlipdd.models import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.spec import MLIPSpec
from torch import nn


class MyMPNN(ModelWrapper):
    """Three layers; per-atom energies; forces and stress come from the base class by autograd."""

    def __init__(self, cutoff: float = 5.0, width: int = 16):
        super().__init__()
        torch.manual_seed(7)
        self.model_config = ModelConfig(NeighborConfig(cutoff))
        self.embed = nn.Parameter(torch.randn(width, dtype=torch.float64))
        self.filters = nn.ModuleList(nn.Linear(8, width, dtype=torch.float64) for _ in range(3))
        self.head = nn.Linear(width, 1, dtype=torch.float64)

    def atomic_energies(self, batch: Batch, positions, cell):
        sender, receiver = batch.neighbors.edge_index
        vec = positions[receiver] + batch.neighbors.shifts(cell, batch.batch) - positions[sender]
        d = vec.norm(dim=1, keepdim=True)
        smooth = torch.where(d < self.cutoff, 0.5 * (torch.cos(math.pi * d / self.cutoff) + 1), 0 * d)
        basis = torch.exp(-((d - torch.linspace(1, self.cutoff, 8, dtype=d.dtype)) ** 2)) * smooth
        h = self.embed.expand(positions.shape[0], -1)
        for layer in self.filters:
            # times `smooth`: lists may reach past the cutoff (Verlet skin), those edges must vanish
            messages = layer(basis) * smooth * h[sender]
            summed = torch.zeros_like(h)
            summed = summed.index_add_(0, receiver, messages)  # rebind: see the README
            h = h + torch.tanh(summed)
        return self.head(h).squeeze(-1)


def validate_once(path: str) -> MLIPSpec:
    from mlipdd.validate import trace_and_validate

    # no sample given: validation builds one sized to the cutoff, so that no rank sees every atom
    report = trace_and_validate(MyMPNN, world_size=2)
    print(report.summary())
    assert report.ok, report.next_action
    report.spec.save(path)
    return report.spec


def main():
    rank = int(os.environ.get("RANK", "0"))
    spec_path = os.path.join(tempfile.gettempdir(), "my_mpnn_spec.json")
    if rank == 0 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        validate_once(spec_path)  # spawns its own ranks; do it before joining a group
    with DistributedManager() as manager:
        spec = MLIPSpec.load(spec_path) if os.path.exists(spec_path) else None
        model = MyMPNN()
        dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.5), spec=spec)
        full = None
        if manager.rank == 0:
            full = fcc_argon(6)
            full.positions += 0.05 * torch.randn(full.positions.shape, dtype=full.dtype)
        owned = dm.partition(full)
        out = dm(owned, compute_stress=True)
        print(f"rank {manager.rank}/{manager.world_size}: {owned.num_atoms} owned atoms, "
              f"energy {float(out['energy'][0]):.6f} eV, max |F| {float(out['forces'].norm(dim=1).max()):.4f} eV/A")


if __name__ == "__main__":
    main()
