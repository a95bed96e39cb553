"""Starting velocities drawn per atom id, so they do not depend on how atoms are split."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from ase import units

from mlipdd.data import Batch, InputError
from mlipdd.dynamics.random import STREAM_INITIAL_VELOCITIES, hash_normal
from mlipdd.dynamics.reduce import SINGLE_PROCESS, GlobalReducer, center_of_mass_velocity


def initialize_velocities(
    batch: Batch,
    temperature: float | Sequence[float],
    seed: int = 0,
    *,
    zero_momentum: bool = True,
    reduce: GlobalReducer = SINGLE_PROCESS,
) -> Batch:
    """Maxwell-Boltzmann velocities at ``temperature`` K (one value or one per system).

    Each atom's velocity is ``sqrt(kB T / m) * xi`` with ``xi`` drawn from
    (seed, atom id) alone; with ``zero_momentum`` each system's centre-of-mass
    velocity is then removed. Velocities are in ASE units (as ``Atoms.get_velocities``).
    Sets ``batch.velocities`` and returns ``batch``.
    """
    t = torch.as_tensor(temperature, dtype=batch.dtype, device=batch.device).reshape(-1)
    if t.numel() == 1:
        t = t.expand(batch.num_systems)
    if t.numel() != batch.num_systems or not bool(torch.isfinite(t).all() & (t >= 0).all()):
        raise InputError(
            f"temperature must be >= 0 K, one value or one per system ({batch.num_systems}); "
            f"got {temperature}"
        )
    if batch.atomic_masses is None:
        raise InputError(
            "the batch has no atomic_masses; build it with AtomicData to get standard masses"
        )
    kT = (units.kB * t)[batch.batch]
    xi = hash_normal(int(seed), STREAM_INITIAL_VELOCITIES, 0, batch.atom_ids, 3)
    sigma = torch.sqrt(kT / batch.atomic_masses).unsqueeze(-1)
    batch.velocities = sigma * xi.to(device=batch.device, dtype=batch.dtype)
    if zero_momentum:
        batch.velocities = batch.velocities - center_of_mass_velocity(batch, reduce)[batch.batch]
    return batch
