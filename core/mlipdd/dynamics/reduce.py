"""Global quantities of a (possibly split) system, all through one coordinator.

# NOTE [one door for global sums]
Under domain decomposition an integrator's ``pre_update``/``post_update`` sees only
the atoms its rank owns. Per-atom math (drift, kick, Langevin friction and noise) is
right as it is; anything summed over atoms is not: kinetic energy, temperature,
degrees of freedom, FIRE's v.f / v.v / f.f, the kinetic part of the pressure. Every
such sum in `mlipdd.dynamics` goes through ``dynamics.reduce``, a `GlobalReducer`:
local per-system partial sums in, global per-system sums out. Single-process the
reducer is the identity; the distributed runtime installs one that all-reduces over
its group. Integrators therefore never call ``torch.distributed`` themselves, and
every rank issues the same reductions in the same order because every rank runs the
same integrator code.

Model outputs (energy, stress) are already global when they reach the integrator:
the distributed model reduces and replicates them.
"""

from __future__ import annotations

import torch
from ase import units

from mlipdd.data import Batch
from mlipdd.models.base import per_system_sum


class GlobalReducer:
    """Single-process coordinator: every local sum already is the global sum.

    A distributed subclass overrides the three reductions (all-reduce SUM / MAX / a
    logical OR) and ``is_root``; nothing else in the dynamics needs to change.
    """

    is_distributed = False

    @property
    def is_root(self) -> bool:
        """True on the one process that writes files and prints."""
        return True

    def sum(self, local: torch.Tensor) -> torch.Tensor:
        """Per-system partial sums (n_systems, ...) -> global per-system sums."""
        return local

    def max(self, local: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over ranks."""
        return local

    def any(self, flag: bool) -> bool:
        """A decision every rank takes together (rebuild, converged, stop)."""
        return bool(flag)


SINGLE_PROCESS = GlobalReducer()


def system_sum(batch: Batch, per_atom: torch.Tensor, reduce: GlobalReducer) -> torch.Tensor:
    """Sum a per-atom quantity over each whole system (all ranks)."""
    return reduce.sum(per_system_sum(per_atom, batch))


def atoms_per_system(batch: Batch, reduce: GlobalReducer) -> torch.Tensor:
    """Global atom count of each system, as the batch's float dtype."""
    return reduce.sum(batch.atoms_per_system.to(batch.dtype))


def degrees_of_freedom(
    batch: Batch, reduce: GlobalReducer, removed_per_system: int = 0
) -> torch.Tensor:
    """3 N per system, minus ``removed_per_system`` (ASE's convention: 3 N, nothing removed)."""
    return 3.0 * atoms_per_system(batch, reduce) - removed_per_system


def kinetic_energy(batch: Batch, reduce: GlobalReducer) -> torch.Tensor:
    """Kinetic energy per system in eV (velocities in ASE units)."""
    per_atom = 0.5 * batch.atomic_masses * (batch.velocities**2).sum(-1)
    return system_sum(batch, per_atom, reduce)


def temperature(
    batch: Batch, reduce: GlobalReducer, removed_dof_per_system: int = 0
) -> torch.Tensor:
    """Instantaneous temperature per system in K."""
    dof = degrees_of_freedom(batch, reduce, removed_dof_per_system)
    return 2.0 * kinetic_energy(batch, reduce) / (dof * units.kB)


def center_of_mass_velocity(batch: Batch, reduce: GlobalReducer) -> torch.Tensor:
    """Velocity of each system's centre of mass, (n_systems, 3)."""
    momentum = system_sum(batch, batch.atomic_masses.unsqueeze(-1) * batch.velocities, reduce)
    mass = system_sum(batch, batch.atomic_masses, reduce)
    return momentum / mass.unsqueeze(-1)
