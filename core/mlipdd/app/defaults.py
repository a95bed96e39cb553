"""Time step and temperature that suit the system, when the user gave none.

The built-in demo is a Lennard-Jones argon fluid: 5 fs and 94 K are right there and wrong
almost everywhere else (a hydrogen stretch has a period near 10 fs; an MLIP run of a
molecule or a material usually wants 0.5-1 fs and room temperature).
"""

from __future__ import annotations

from collections.abc import Iterable

NOBLE_GASES = frozenset({2, 10, 18, 36, 54, 86})
HYDROGEN = 1


def default_timestep(atomic_numbers: Iterable[int]) -> float:
    """fs: 5 for noble-gas fluids, 0.5 with hydrogen, 1 otherwise."""
    species = {int(z) for z in atomic_numbers}
    if species and species <= NOBLE_GASES:
        return 5.0
    return 0.5 if HYDROGEN in species else 1.0


def default_temperature(atomic_numbers: Iterable[int]) -> float:
    """K: 94 (liquid argon) for noble-gas fluids, 300 otherwise."""
    species = {int(z) for z in atomic_numbers}
    return 94.0 if species and species <= NOBLE_GASES else 300.0


def timestep_warning(dt_fs: float, atomic_numbers: Iterable[int]) -> str | None:
    """A one-line warning when an explicit time step is long for these atoms, else None."""
    species = {int(z) for z in atomic_numbers}
    suggested = default_timestep(species)
    if dt_fs <= 2.0 * suggested:
        return None
    why = ("bonds to hydrogen vibrate with periods near 10 fs" if HYDROGEN in species
           else "bonded atoms vibrate with periods of 20-50 fs")
    return (f"warning: a {dt_fs:g} fs time step is long for this system ({why}); "
            f"--dt {suggested:g} is the default for it")
