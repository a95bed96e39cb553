"""Per-atom values of RAW positions under the aten dispatch equal one process, halo and sharded.

A feature of raw positions read by the edge index (``torch.sin(positions)[sender]``) and raw
positions times a scatter by sender (``(positions * q[:, None]).sum()``, ``q`` holding shares on
ghost rows) need every ghost row of the positions to be its owner's own position: halo storage
once kept ghosts at their images there, and both energies were wrong (1e-3 .. 1 at 2 ranks,
silently). Ghost rows are copies now, their image shifts on the edges (NOTE [ghosts as copies]).
"""

from __future__ import annotations

import functools

import pytest
import torch
from mlipdd.models.lj import LennardJones
from mlipdd.testing.conformance import cases_off
from mlipdd.testing.systems import slab, small_cell, triclinic


class LJWithPositionValues(LennardJones):
    """LJ plus a per-atom value of the raw positions, used through the edge list (within the cutoff)."""

    def __init__(self, term: str):
        super().__init__(epsilon=0.0123, sigma=2.5, cutoff=5.0)
        self.term = term

    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        sender, receiver = batch.neighbors.edge_index[0], batch.neighbors.edge_index[1]
        v = positions.index_select(0, receiver) - positions.index_select(0, sender) \
            + batch.neighbors.shifts(cell, batch.batch)
        r2 = (v * v).sum(-1)
        inside = r2 < self.cutoff ** 2
        if self.term == "feature_read_by_sender":
            h = torch.sin(positions).sum(1)
            extra = torch.where(inside, 0.1 * h.index_select(0, sender), torch.zeros_like(r2)).sum()
        else:  # "positions_times_sender_scatter": a weight that is not symmetric in the pair
            w = torch.where(inside, torch.exp(-r2 / 20.0), torch.zeros_like(r2))
            c = torch.zeros(positions.shape[0], dtype=positions.dtype).index_add(0, receiver, w * w)
            w = w * (1 + c.index_select(0, receiver))
            q = torch.zeros(positions.shape[0], dtype=positions.dtype).index_add(0, sender, w)
            extra = (positions * q.unsqueeze(1)).sum()
        return energies + 3e-3 * extra


TERMS = ("feature_read_by_sender", "positions_times_sender_scatter")


def _outcomes(strategy: str, world_size: int) -> dict:
    systems = {"triclinic": triclinic(spacing=3.0, reps=4), "small_cell": small_cell(spacing=3.0, reps=3),
               "slab": slab(spacing=3.0)}
    cases, names = [], []
    for term in TERMS:
        for name, batch in systems.items():
            cases.append((functools.partial(LJWithPositionValues, term), batch, {"strategy": strategy}))
            names.append(f"{term}/{name}")
    bad = cases_off(cases, names, world_size)
    return bad


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
@pytest.mark.parametrize("strategy", ["halo", "sharded"])
def test_position_values_equal_one_process(strategy, world_size):
    bad = _outcomes(strategy, world_size)
    assert not bad, f"{world_size} ranks differ from one process: {bad}"
