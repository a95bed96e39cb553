"""Stress of energy terms in RAW positions under the aten dispatch (NOTE [shares plus a replicated value]).

A Lennard-Jones energy plus a term in the positions themselves (``positions.sum()``, ``.mean()``,
a centre of mass, ``positions @ W``, ``(positions ** 2).sum()``, ``positions.norm()``) or in the cell:
the term's gradient is a replicated value added to the edges' shares, and summing the shares into
their owners there dropped the ghost images' lattice shifts from the virial (stress 1e-4 .. 1e-1
off at 2 ranks, energy and forces exact). Halo and sharded storage at 2/3/4 gloo ranks, float64,
triclinic, a cell whose ranks see their own images, a slab with vacuum: energy, forces and stress
to 1e-10 relative of one process.
"""

from __future__ import annotations

import functools

import pytest
import torch
from mlipdd.models.lj import LennardJones
from mlipdd.testing.conformance import check_conformance_cases
from mlipdd.testing.systems import slab, small_cell, triclinic


def _raw_term(term: str, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
    if term == "sum":
        return positions.sum()
    if term == "mean":
        return positions.mean()
    if term == "centre_of_mass":
        return (positions.mean(0) ** 2).sum()
    if term == "matmul":
        w = torch.arange(9, dtype=positions.dtype, device=positions.device).reshape(3, 3) / 10
        return (positions @ w).sum()
    if term == "squares":
        return (positions ** 2).sum()
    if term == "norm":
        return positions.norm()
    if term == "cell":
        return cell.sum() + positions.sum() * torch.sin(cell).sum()  # sin: no count of rows by chance (NOTE [aten counts])
    raise ValueError(term)


class LJWithRawTerm(LennardJones):
    """LJ plus ``strength * term(positions, cell)`` spread evenly over the atoms' energies."""

    def __init__(self, term: str, strength: float = 3e-3):
        # epsilon 0.01 made 4 * eps = 0.04 = 1 / 25, a ratio of one rank's row counts at 4 ranks: refused (NOTE [aten counts])
        super().__init__(epsilon=0.0123, sigma=2.5, cutoff=5.0)
        self.term, self.strength = term, strength

    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        return energies + self.strength * _raw_term(self.term, positions, cell)


TERMS = ("sum", "mean", "centre_of_mass", "matmul", "squares", "norm", "cell")


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_stress_of_raw_position_terms_equals_one_process(world_size):
    systems = {"triclinic": triclinic(spacing=3.0, reps=4), "small_cell": small_cell(spacing=3.0, reps=3),
               "slab": slab(spacing=3.0, reps=(4, 4, 2))}
    cases, names = [], []
    for term in TERMS:
        factory = functools.partial(LJWithRawTerm, term)
        for strategy in ("halo", "sharded"):
            for name, batch in systems.items():
                cases.append((factory, batch, {"strategy": strategy}))
                names.append(f"{term}/{strategy}/{name}")
    bad = {}
    for (result, _), name in zip(check_conformance_cases(cases, world_size), names):
        limits = {"energy": 1e-10, "forces": 1e-10, "stress": 1e-10}
        off = {k: v for k, v in result.rel_diff.items() if not v <= limits[k]}
        if off:
            bad[name] = off
    assert not bad, f"{world_size} ranks differ from one process: {bad}"
