"""Lennard-Jones pair potential: the reference model every distributed path is checked on.

Plain torch on purpose. The pair energy is

    phi(r) = 4 eps_ij [(sigma_ij / r)^12 - (sigma_ij / r)^6] - phi_raw(r_c)   for r < r_c

(``shift=True`` subtracts the value at the cutoff so the energy is continuous there;
this is also what ASE's ``LennardJones(smooth=False)`` computes). Each atom gets half of
each of its pair energies, scattered into the receiver of the edge. Forces and stress
come from the base class by autograd (positions, and the strain route for stress).

Written in the ops the distributed dispatch understands: positions are read with
``index_select`` and edge energies leave through an out-of-place ``index_add`` whose
result is rebound, so under domain decomposition the same code refreshes ghost rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from mlipdd.data import Batch, InputError
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig, capturing
from mlipdd.neighbors import NeighborList, build_neighbor_list

MIXING_RULES = ("lorentz_berthelot", "geometric")
_NUM_ELEMENTS = 119  # tables are indexed by atomic number 0..118


class LennardJones(ModelWrapper):
    """Lennard-Jones with one or several species.

    ``epsilon`` and ``sigma`` are scalars (one species, or every atom alike) or dicts
    keyed by atomic number; unlike pairs are mixed by ``mixing``:
    ``"lorentz_berthelot"`` (sigma arithmetic mean, epsilon geometric mean) or
    ``"geometric"`` (both geometric means). ``cutoff`` defaults to 3 x the largest sigma.
    """

    def __init__(
        self,
        epsilon: float | Mapping[int, float] = 1.0,
        sigma: float | Mapping[int, float] = 1.0,
        cutoff: float | None = None,
        mixing: str = "lorentz_berthelot",
        shift: bool = True,
    ):
        super().__init__()
        if mixing not in MIXING_RULES:
            raise InputError(f"unknown mixing rule {mixing!r}; use one of {MIXING_RULES}")
        eps_table, eps_known = _species_table(epsilon, "epsilon")
        sigma_table, sigma_known = _species_table(sigma, "sigma")
        if cutoff is None:
            cutoff = 3.0 * float(sigma_table[sigma_known].max())
        if not cutoff > 0:
            raise InputError(f"cutoff must be positive, got {cutoff}")
        self.mixing = mixing
        self.shift = shift
        self.model_config = ModelConfig(neighbor_config=NeighborConfig(cutoff=float(cutoff)))
        # pair tables (119 x 119, ~110 kB each) make the per-edge lookup one gather
        if mixing == "lorentz_berthelot":
            pair_sigma = 0.5 * (sigma_table[:, None] + sigma_table[None, :])
        else:
            pair_sigma = torch.sqrt(sigma_table[:, None] * sigma_table[None, :])
        pair_eps = torch.sqrt(eps_table[:, None] * eps_table[None, :])
        # flattened so one index_select by (z_sender * 119 + z_receiver) finds a pair
        self.register_buffer("pair_epsilon", pair_eps.flatten())
        self.register_buffer("pair_sigma", pair_sigma.flatten())
        # one parameter set for every atom: skip the per-edge lookups altogether
        self._uniform = None
        if not isinstance(epsilon, Mapping) and not isinstance(sigma, Mapping):
            self._uniform = (float(epsilon), float(sigma))
        self.register_buffer("known_species", eps_known & sigma_known)
        self._all_species_known = bool(self.known_species.all())  # skip the check (a sync)

    def distribution_spec(self, strategy=None):
        return None

    def extra_repr(self) -> str:
        return f"cutoff={self.cutoff}, mixing={self.mixing!r}, shift={self.shift}"

    # ---- energy ---------------------------------------------------------------------
    def neighbors_for(self, batch: Batch) -> NeighborList:
        """The batch's attached list when it reaches far enough, else a fresh one."""
        neighbors = batch.neighbors
        if neighbors is None:
            return build_neighbor_list(batch, self.cutoff)
        if neighbors.cutoff is not None and neighbors.cutoff < self.cutoff * (1 - 1e-12):
            raise InputError(
                f"the attached neighbour list was built with cutoff {neighbors.cutoff} but this "
                f"Lennard-Jones model needs {self.cutoff}; rebuild it with at least the model cutoff"
            )
        return neighbors

    def atomic_energies(
        self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor
    ) -> torch.Tensor:
        self._check_species(batch.atomic_numbers)
        neighbors = self.neighbors_for(batch)
        sender, receiver = neighbors.edge_index[0], neighbors.edge_index[1]

        vectors = (
            positions.index_select(0, receiver)
            + neighbors.shifts(cell, batch.batch)
            - positions.index_select(0, sender)
        )
        r2 = (vectors * vectors).sum(dim=-1)

        eps, sigma2 = self._pair_parameters(batch.atomic_numbers, sender, receiver, positions.dtype)

        rc2 = self.cutoff**2
        inside = r2 < rc2  # lists built with a skin hold longer edges; they add nothing
        # longer edges are replaced by r = r_c before the power so no inf/NaN can leak
        # into the gradient through the discarded branch of the `where`
        safe_r2 = torch.where(inside, r2, torch.full_like(r2, rc2))
        s2_over_r2 = sigma2 / safe_r2
        c6 = s2_over_r2 * s2_over_r2 * s2_over_r2
        pair = 4.0 * eps * (c6 * c6 - c6)
        if self.shift:
            c6_cut = (sigma2 / rc2) ** 3
            pair = pair - 4.0 * eps * (c6_cut * c6_cut - c6_cut)
        half = 0.5 * torch.where(inside, pair, torch.zeros_like(pair))

        energies = torch.zeros(positions.shape[0], dtype=positions.dtype, device=positions.device)
        energies = energies.index_add(0, receiver, half)
        if not neighbors.full_list:  # a half list holds each pair once: the sender's half too
            energies = energies.index_add(0, sender, half)
        return energies

    def _pair_parameters(self, z, sender, receiver, dtype):
        """Per-edge epsilon and sigma^2 (Python floats when every atom is alike)."""
        if self._uniform is not None:
            eps, sigma = self._uniform
            return eps, sigma * sigma
        pair = z.index_select(0, sender) * _NUM_ELEMENTS + z.index_select(0, receiver)
        eps = self.pair_epsilon.to(dtype).index_select(0, pair)
        sigma = self.pair_sigma.to(dtype).index_select(0, pair)
        return eps, sigma * sigma

    def _check_species(self, atomic_numbers: torch.Tensor) -> None:
        if self._all_species_known or capturing(atomic_numbers):  # a capture: checked in the warm-up
            return
        present = torch.unique(atomic_numbers.detach().as_subclass(torch.Tensor)).cpu()
        missing = [int(zi) for zi in present if not bool(self.known_species[zi])]
        if missing:
            raise InputError(
                f"Lennard-Jones has no epsilon/sigma for atomic number(s) {missing}; add them "
                "to the epsilon and sigma dicts"
            )


def _species_table(value, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-atomic-number table (float64) and the mask of species it defines."""
    table = torch.zeros(_NUM_ELEMENTS, dtype=torch.float64)
    known = torch.zeros(_NUM_ELEMENTS, dtype=torch.bool)
    if isinstance(value, Mapping):
        for z, v in value.items():
            if not 0 < int(z) < _NUM_ELEMENTS:
                raise InputError(f"{name} given for atomic number {z}; use keys 1..118")
            table[int(z)] = _positive(v, name)
            known[int(z)] = True
        if not known.any():
            raise InputError(f"{name} is an empty dict; give at least one species")
    else:
        table[:] = _positive(value, name)
        known[:] = True
    return table, known


def _positive(v, name: str) -> float:
    v = float(v)
    if not (v > 0 and math.isfinite(v)):
        raise InputError(f"{name} must be positive and finite, got {v}")
    return v
