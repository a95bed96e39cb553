"""Models for the calculator's fault cases; importable by spawned ranks (the tests' own
directory is on their path), so every rank builds the same one."""

from __future__ import annotations

import time

import torch
from mlipdd.models.lj import LennardJones

ARGON = {"epsilon": 0.0104, "sigma": 3.4, "cutoff": 5.5}


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class NaNAboveVolume(LennardJones):
    """LJ argon whose energy is NaN once the cell's volume exceeds ``volume`` (A^3): a model
    finite on one geometry and not on the next, without overlapping atoms (a cell quantity,
    so ghost copies of atoms see the same as their owners)."""

    def __init__(self, volume: float):
        super().__init__(**ARGON)
        self.volume = float(volume)

    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        too_big = torch.linalg.det(cell).abs().max() > self.volume
        return energies + torch.where(too_big, torch.nan, 0.0)


class SlowOnRank(LennardJones):
    """LJ argon that sleeps ``seconds`` on ``rank`` when the cell's volume exceeds ``volume``
    (A^3): a rank busy or hung in one chosen call (a geometry, not a call count: the first
    call may run the model more than once)."""

    def __init__(self, rank: int, volume: float, seconds: float):
        super().__init__(**ARGON)
        self.slow_rank, self.volume, self.seconds = int(rank), float(volume), float(seconds)

    def atomic_energies(self, batch, positions, cell):
        if _rank() == self.slow_rank and float(torch.linalg.det(cell).abs().max()) > self.volume:
            time.sleep(self.seconds)
        return super().atomic_energies(batch, positions, cell)
