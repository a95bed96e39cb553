"""Built-in test systems (built with ase.build), returned as a `Batch`.

``size`` is the number of conventional cubic cells along each axis (an int or three
ints); ``n_atoms`` instead asks for about that many atoms (the nearest cube of cells).
With a ``temperature`` (K) the batch also gets Maxwell-Boltzmann velocities drawn by
atom id from ``seed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mlipdd.data import Batch, InputError

ARGON_LATTICE = 5.26  # A, FCC argon near 0 K
# liquid argon near its boiling point (87 K .. 94 K): ~1.37 g/cm^3 -> atoms per A^3
ARGON_LIQUID_DENSITY = 0.0207
SILICON_LATTICE = 5.431  # A, diamond silicon
MOLTEN_NACL_LATTICE = 6.30  # A, rock salt (5.64 A at 2.17 g/cm^3) expanded to the melt's 1.55 g/cm^3


def _repeats(size, n_atoms, atoms_per_cell: int, default: int) -> tuple[int, int, int]:
    if size is not None and n_atoms is not None:
        raise InputError("give either size (cells per axis) or n_atoms, not both")
    if n_atoms is not None:
        if int(n_atoms) < 1:
            raise InputError(f"n_atoms must be >= 1, got {n_atoms}")
        n = max(1, round((int(n_atoms) / atoms_per_cell) ** (1.0 / 3.0)))
        return (n, n, n)
    size = default if size is None else size
    reps = (int(size),) * 3 if isinstance(size, (int, float)) else tuple(int(s) for s in size)
    if len(reps) != 3 or min(reps) < 1:
        raise InputError(f"size must be a positive int or three of them, got {size}")
    return reps


def _finish(atoms, temperature, seed, dtype, device) -> Batch:
    batch = Batch.from_ase(atoms, dtype=dtype, device=device)
    if temperature is not None:
        from mlipdd.dynamics.velocities import initialize_velocities

        initialize_velocities(batch, temperature, seed)
    return batch


def fcc_argon(
    size: int | Sequence[int] | None = None,
    *,
    n_atoms: int | None = None,
    a: float = ARGON_LATTICE,
    temperature: float | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device=None,
) -> Batch:
    """Periodic FCC argon, 4 atoms per cubic cell (default 10^3 cells = 4000 atoms)."""
    from ase.build import bulk

    reps = _repeats(size, n_atoms, 4, default=10)
    atoms = bulk("Ar", "fcc", a=float(a), cubic=True).repeat(reps)
    return _finish(atoms, temperature, seed, dtype, device)


def lj_liquid(
    size: int | Sequence[int] | None = None,
    *,
    n_atoms: int | None = None,
    density: float = ARGON_LIQUID_DENSITY,
    temperature: float | None = 94.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device=None,
) -> Batch:
    """Argon at liquid density (atoms per A^3), started as an expanded FCC lattice with
    velocities at ``temperature``; it melts within a few picoseconds of MD."""
    if not density > 0:
        raise InputError(f"density must be positive (atoms per A^3), got {density}")
    a = (4.0 / float(density)) ** (1.0 / 3.0)
    return fcc_argon(
        size, n_atoms=n_atoms, a=a, temperature=temperature, seed=seed, dtype=dtype, device=device
    )


def silicon_diamond(
    size: int | Sequence[int] | None = None,
    *,
    n_atoms: int | None = None,
    a: float = SILICON_LATTICE,
    temperature: float | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device=None,
) -> Batch:
    """Periodic diamond silicon, 8 atoms per cubic cell (default 4^3 cells = 512 atoms)."""
    from ase.build import bulk

    reps = _repeats(size, n_atoms, 8, default=4)
    atoms = bulk("Si", "diamond", a=float(a), cubic=True).repeat(reps)
    return _finish(atoms, temperature, seed, dtype, device)


def molten_salt(
    size: int | Sequence[int] | None = None,
    *,
    n_atoms: int | None = None,
    a: float = MOLTEN_NACL_LATTICE,
    temperature: float | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device=None,
) -> Batch:
    """NaCl at the density of the melt (~1.55 g/cm^3 near 1100 K), started as an expanded
    rock-salt lattice (8 ions per cubic cell, default 5^3 cells = 1000 ions). Carries no
    charges: an electrostatics model assigns them (e.g. by element)."""
    from ase.build import bulk

    reps = _repeats(size, n_atoms, 8, default=5)
    atoms = bulk("NaCl", "rocksalt", a=float(a), cubic=True).repeat(reps)
    return _finish(atoms, temperature, seed, dtype, device)


SYSTEMS: dict[str, Callable[..., Batch]] = {
    "molten_salt": molten_salt,
    "fcc_argon": fcc_argon,
    "argon": fcc_argon,
    "lj_liquid": lj_liquid,
    "silicon": silicon_diamond,
    "silicon_diamond": silicon_diamond,
}


def build_system(name: str, **kwargs) -> Batch:
    """One of `SYSTEMS` by name, with the builder's keyword arguments."""
    try:
        builder = SYSTEMS[name]
    except KeyError:
        raise InputError(
            f"unknown built-in system {name!r}; use one of {sorted(SYSTEMS)} or a structure file "
            "ase.io can read"
        ) from None
    return builder(**kwargs)
