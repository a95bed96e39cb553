"""Atomic systems: one system (`AtomicData`) and several concatenated (`Batch`).

A `Batch` stores per-atom fields ("node properties", first dimension = atoms) and
per-system fields ("system properties", first dimension = systems) in two dicts and
exposes both as attributes: ``batch.positions``, ``batch.cell``. The row layout is the
usual concatenation: atoms of system 0, then system 1, ...; ``batch.batch`` maps each
atom to its system and ``batch.ptr`` holds the system boundaries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ase.data import atomic_masses as _ASE_MASSES
from ase.data import chemical_symbols

# Fields with a fixed meaning. Everything else is an "extra" property that travels
# with its atom (node) or system through batching, partitioning and migration.
NODE_FIELDS = ("positions", "atomic_numbers", "atomic_masses", "velocities", "forces", "atom_ids")
SYSTEM_FIELDS = ("cell", "pbc", "charge", "spin", "energy", "stress")


class InputError(ValueError):
    """Bad input; the message names the problem and the fix."""


def default_masses(atomic_numbers: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """Standard atomic masses (amu) by element, from ASE's table."""
    z = atomic_numbers.detach().cpu().numpy()
    _check_elements(z)
    return torch.as_tensor(_ASE_MASSES[z], dtype=dtype, device=atomic_numbers.device)


def _check_elements(z: np.ndarray) -> None:
    bad = np.unique(z[(z < 1) | (z >= len(chemical_symbols))])
    if bad.size:
        raise InputError(
            f"unknown element(s) with atomic number {bad.tolist()}: atomic numbers must lie in "
            f"1..{len(chemical_symbols) - 1}; fix the atomic_numbers of the input"
        )


def _as_cell(cell, dtype, device) -> torch.Tensor:
    cell = torch.as_tensor(cell, dtype=dtype, device=device)
    if cell.shape == (3,):
        cell = torch.diag(cell)
    if cell.shape == (3, 3):
        cell = cell.unsqueeze(0)
    return cell


def _as_pbc(pbc, device) -> torch.Tensor:
    pbc = torch.as_tensor(pbc, dtype=torch.bool, device=device)
    if pbc.dim() == 0:
        pbc = pbc.repeat(3)
    if pbc.shape == (3,):
        pbc = pbc.unsqueeze(0)
    return pbc


class Batch:
    """Several atomic systems in one set of tensors (see module docstring)."""

    def __init__(self, node: dict[str, torch.Tensor], system: dict[str, torch.Tensor]):
        object.__setattr__(self, "node", dict(node))
        object.__setattr__(self, "system", dict(system))
        if "atom_ids" not in self.node:
            self.node["atom_ids"] = torch.arange(self.num_atoms, device=self.device)
        if "batch" not in self.node:
            self.node["batch"] = torch.zeros(self.num_atoms, dtype=torch.long, device=self.device)

    # ---- attribute access -------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        for store in ("node", "system"):
            d = self.__dict__.get(store, {})
            if name in d:
                return d[name]
        if name in NODE_FIELDS or name in SYSTEM_FIELDS or name == "neighbors":
            return None
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "neighbors":  # edge-shaped: neither a node nor a system property
            object.__setattr__(self, name, value)
        elif name in self.system or name in SYSTEM_FIELDS:
            self.system[name] = value
        else:
            self.node[name] = value

    def add_node_property(self, name: str, value: torch.Tensor) -> None:
        value = torch.as_tensor(value, device=self.device)
        if value.shape[0] != self.num_atoms:
            raise InputError(
                f"node property {name!r} has {value.shape[0]} rows but the system has "
                f"{self.num_atoms} atoms; give one row per atom"
            )
        self.node[name] = value

    def add_system_property(self, name: str, value: torch.Tensor) -> None:
        value = torch.as_tensor(value, device=self.device)
        if value.shape[0] != self.num_systems:
            raise InputError(
                f"system property {name!r} has {value.shape[0]} rows for {self.num_systems} "
                "systems; give one row per system"
            )
        self.system[name] = value

    # ---- sizes and layout -------------------------------------------------------------
    @property
    def num_atoms(self) -> int:
        return self.node["positions"].shape[0]

    @property
    def num_systems(self) -> int:
        return int(self.system["cell"].shape[0])

    @property
    def device(self) -> torch.device:
        return self.node["positions"].device

    @property
    def dtype(self) -> torch.dtype:
        return self.node["positions"].dtype

    @property
    def ptr(self) -> torch.Tensor:
        counts = torch.bincount(self.node["batch"], minlength=self.num_systems)
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)])

    @property
    def atoms_per_system(self) -> torch.Tensor:
        return torch.bincount(self.node["batch"], minlength=self.num_systems)

    def __len__(self) -> int:
        return self.num_systems

    def __repr__(self) -> str:
        return f"Batch(systems={self.num_systems}, atoms={self.num_atoms}, fields={sorted(self.node) + sorted(self.system)})"

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def from_data_list(cls, data_list: Sequence[Batch], device=None) -> Batch:
        """Concatenate systems (each an `AtomicData` or `Batch`) into one batch."""
        if not data_list:
            raise InputError("from_data_list got an empty list; pass at least one system")
        node_keys = set(data_list[0].node)
        sys_keys = set(data_list[0].system)
        for d in data_list[1:]:
            if set(d.node) != node_keys or set(d.system) != sys_keys:
                raise InputError(
                    "systems in one batch must carry the same fields; got "
                    f"{sorted(node_keys | sys_keys)} and {sorted(set(d.node) | set(d.system))}"
                )
        node = {}
        offset = 0
        batches = []
        for d in data_list:
            batches.append(d.node["batch"] + offset)
            offset += d.num_systems
        for k in node_keys - {"batch", "atom_ids"}:
            node[k] = torch.cat([d.node[k] for d in data_list])
        node["batch"] = torch.cat(batches)
        system = {k: torch.cat([d.system[k] for d in data_list]) for k in sys_keys}
        out = cls(node, system)  # fresh global ids 0..N-1 in batch order
        return out.to(device) if device is not None else out

    def to_data_list(self) -> list[AtomicData]:
        out = []
        for s in range(self.num_systems):
            mask = self.node["batch"] == s
            node = {k: v[mask] for k, v in self.node.items() if k not in ("batch", "atom_ids")}
            system = {k: v[s : s + 1] for k, v in self.system.items()}
            out.append(AtomicData._from_dicts(node, system))
        return out

    def select_atoms(self, index: torch.Tensor) -> Batch:
        """A batch holding the atoms ``index`` (mask or indices); all systems are kept."""
        node = {k: v[index] for k, v in self.node.items()}
        return Batch(node, dict(self.system))

    def to(self, device=None, dtype=None) -> Batch:
        def move(k, v):
            if not torch.is_tensor(v):
                return v
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
            return v.to(device) if device is not None else v

        node = {k: move(k, v) for k, v in self.node.items()}
        system = {k: move(k, v) for k, v in self.system.items()}
        return type(self)._from_dicts(node, system)

    def clone(self) -> Batch:
        return type(self)._from_dicts(
            {k: v.clone() for k, v in self.node.items()},
            {k: v.clone() for k, v in self.system.items()},
        )

    @classmethod
    def _from_dicts(cls, node, system):
        obj = cls.__new__(cls)
        object.__setattr__(obj, "node", dict(node))
        object.__setattr__(obj, "system", dict(system))
        if "batch" not in obj.node:
            obj.node["batch"] = torch.zeros(obj.num_atoms, dtype=torch.long, device=obj.device)
        if "atom_ids" not in obj.node:
            obj.node["atom_ids"] = torch.arange(obj.num_atoms, device=obj.device)
        return obj

    # ---- ASE ----------------------------------------------------------------------------
    @classmethod
    def from_ase(cls, atoms, dtype=torch.float64, device=None) -> Batch:
        """From one ASE `Atoms` or a list of them."""
        items = [atoms] if not isinstance(atoms, (list, tuple)) else list(atoms)
        return cls.from_data_list([AtomicData.from_ase(a, dtype, device) for a in items])

    @classmethod
    def read(cls, path: str | Path, index=":", dtype=torch.float64, device=None) -> Batch:
        """Any file ASE reads (extxyz, POSCAR, CIF, trajectory, ...)."""
        import ase.io

        frames = ase.io.read(str(path), index=index)
        return cls.from_ase(frames, dtype=dtype, device=device)

    def to_ase(self) -> list:
        return [d.to_ase() for d in self.to_data_list()]

    # ---- validation ---------------------------------------------------------------------
    def validate(self, require: Iterable[str] = ()) -> Batch:
        """Raise `InputError` naming the problem and the fix; returns self."""
        validate_batch(self, require)
        return self


class AtomicData(Batch):
    """One atomic system. ``cell`` is (1, 3, 3) (a (3, 3) cell is accepted), ``pbc`` (1, 3)."""

    def __init__(
        self,
        positions,
        atomic_numbers,
        atomic_masses=None,
        cell=None,
        pbc=None,
        velocities=None,
        charge: float | None = None,
        spin: float | None = None,
        dtype: torch.dtype | None = None,
        device=None,
    ):
        given_tensor = isinstance(positions, (torch.Tensor, np.ndarray))
        positions = torch.as_tensor(positions, device=device)
        if dtype is None:  # Python lists default to float64, like the rest of the field
            dtype = positions.dtype if given_tensor and positions.is_floating_point() else torch.float64
        positions = positions.to(dtype)
        device = positions.device
        z = torch.as_tensor(atomic_numbers, dtype=torch.long, device=device)
        if atomic_masses is None:
            atomic_masses = default_masses(z, dtype)
        node = {
            "positions": positions,
            "atomic_numbers": z,
            "atomic_masses": torch.as_tensor(atomic_masses, dtype=dtype, device=device),
        }
        if velocities is not None:
            node["velocities"] = torch.as_tensor(velocities, dtype=dtype, device=device)
        if cell is None:
            cell = torch.zeros(3, 3)
            pbc = False if pbc is None else pbc
        system = {
            "cell": _as_cell(cell, dtype, device),
            "pbc": _as_pbc(True if pbc is None else pbc, device),
        }
        if charge is not None:
            system["charge"] = torch.tensor([float(charge)], dtype=dtype, device=device)
        if spin is not None:
            system["spin"] = torch.tensor([float(spin)], dtype=dtype, device=device)
        super().__init__(node, system)

    @classmethod
    def from_ase(cls, atoms, dtype=torch.float64, device=None) -> AtomicData:
        _check_elements(np.asarray(atoms.get_atomic_numbers()))  # before ASE's mass table lookup
        d = cls(
            positions=torch.as_tensor(atoms.get_positions(), dtype=dtype),
            atomic_numbers=atoms.get_atomic_numbers(),
            atomic_masses=atoms.get_masses(),
            cell=np.asarray(atoms.get_cell()),
            pbc=atoms.get_pbc(),
            dtype=dtype,
            device=device,
        )
        if atoms.has("momenta"):
            d.add_node_property("velocities", torch.as_tensor(atoms.get_velocities(), dtype=dtype, device=device))
        charge = atoms.info.get("charge")
        if charge is not None:
            d.system["charge"] = torch.tensor([float(charge)], dtype=dtype, device=device)
        spin = atoms.info.get("spin")
        if spin is not None:
            d.system["spin"] = torch.tensor([float(spin)], dtype=dtype, device=device)
        return d

    def to_ase(self):
        from ase import Atoms
        from ase.calculators.singlepoint import SinglePointCalculator

        atoms = Atoms(
            numbers=self.atomic_numbers.cpu().numpy(),
            positions=self.positions.detach().cpu().numpy(),
            cell=self.cell[0].detach().cpu().numpy(),
            pbc=self.pbc[0].cpu().numpy(),
            masses=self.atomic_masses.detach().cpu().numpy(),
        )
        if self.velocities is not None:
            atoms.set_velocities(self.velocities.detach().cpu().numpy())
        results = {}
        if self.energy is not None:
            results["energy"] = float(self.energy.reshape(-1)[0])
        if self.forces is not None:
            results["forces"] = self.forces.detach().cpu().numpy()
        if self.stress is not None:
            s = self.stress.reshape(3, 3).detach().cpu().numpy()
            results["stress"] = s[[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]]
        if results:
            atoms.calc = SinglePointCalculator(atoms, **results)
        return atoms


def check_not_empty(batch: Batch) -> None:
    """A whole system (not one rank's part of it) must hold atoms: with none there is no
    temperature, no per-atom energy, no box to split; say so instead of dividing by zero."""
    counts = batch.atoms_per_system.tolist() if batch.num_systems else []
    empty = [s for s, n in enumerate(counts) if n == 0]
    if batch.num_atoms == 0 or empty:
        which = "the system has no atoms" if len(counts) <= 1 else f"systems {empty} have no atoms"
        raise InputError(
            f"{which}; give a structure with at least one atom (an empty or unreadable file? "
            "check the structure file and the --system argument)"
        )


def validate_batch(batch: Batch, require: Iterable[str] = ()) -> None:
    """Checks every rule that would otherwise give a silently wrong answer or a crash deep inside."""
    n = batch.num_atoms
    pos = batch.positions
    if pos.dim() != 2 or pos.shape[1] != 3:
        raise InputError(f"positions must have shape (n_atoms, 3), got {tuple(pos.shape)}")
    for name in require:
        if getattr(batch, name) is None:
            hint = (
                ' (attach them with data.add_node_property("velocities", v) or draw them from a '
                "temperature)"
                if name == "velocities"
                else ""
            )
            raise InputError(f"the integrator needs {name!r} but the batch has none{hint}")
    for name, v in batch.node.items():
        if torch.is_tensor(v) and v.shape[0] != n:
            raise InputError(f"node property {name!r} has {v.shape[0]} rows for {n} atoms")
        if torch.is_tensor(v) and v.is_floating_point() and not torch.isfinite(v).all():
            bad = torch.nonzero(~torch.isfinite(v.reshape(n, -1)).all(1)).flatten()[:5].tolist()
            raise InputError(
                f"{name} contain NaN or inf (first atoms: {bad}); the system blew up or was built "
                "wrongly: check the input structure, or lower the time step if this happened in MD"
            )
    _check_elements(batch.atomic_numbers.detach().cpu().numpy())
    cell, pbc = batch.cell, batch.pbc
    if cell.shape != (batch.num_systems, 3, 3) or pbc.shape != (batch.num_systems, 3):
        raise InputError(
            f"cell must be (n_systems, 3, 3) and pbc (n_systems, 3); got {tuple(cell.shape)} and "
            f"{tuple(pbc.shape)}"
        )
    if not torch.isfinite(cell).all():
        raise InputError("cell contains NaN or inf; give a finite 3x3 cell")
    for s in range(batch.num_systems):
        if pbc[s].any():
            vol = torch.det(cell[s]).abs()
            if vol < 1e-8 * (cell[s].norm() ** 3 + 1e-30):
                raise InputError(
                    f"system {s}: the cell is singular (volume {float(vol):.3g}) but the system is "
                    "periodic; give three linearly independent cell vectors"
                )
    if batch.atomic_masses is not None and (batch.atomic_masses <= 0).any():
        raise InputError("atomic masses must be positive; leave them out to use standard masses")
    check_no_overlaps(batch)


# Atoms this close are one atom placed twice (a duplicated site, a bad merge of two
# structures), never chemistry: the shortest bond (H2) is 0.74 A. Models give NaN at
# distance 0 (a direction of a zero vector), and at two ranks the NaN surfaced as a
# misleading "dropped scatter rebind" message.
OVERLAP_DISTANCE = 0.01
# NOTE [overlap search radius]: the overlap test's list is built at this radius, then cut to
# the overlap distance. vesin bins space into cells about one radius wide: a 0.01 A list of a
# 54-atom slab with 14 A of vacuum took 1.5 s (every partition and rebuild pays it; most of
# an idiom-zoo case), at 1.5 A 1 ms. Below most bonds; the few listed (O-H 0.96 A, C-H
# 1.09 A) are cut again, so the list stays linear in the atoms.
OVERLAP_SEARCH_RADIUS = 1.5


def check_no_overlaps(batch: Batch, distance: float = OVERLAP_DISTANCE) -> None:
    """Raise `InputError` naming two atoms (ids, periodic images included) closer than
    ``distance`` Angstrom. A neighbour list of that radius: linear in the atoms."""
    from mlipdd.neighbors import build_neighbor_list

    if batch.num_atoms < 2 and not bool(batch.pbc.any()):
        return
    if batch.positions.device.type != "cpu":
        batch = _host_geometry(batch)
    pairs = build_neighbor_list(batch, max(distance, OVERLAP_SEARCH_RADIUS), full_list=False)
    if pairs.num_edges == 0:
        return
    plain = [t.detach().as_subclass(torch.Tensor) for t in (batch.positions, batch.cell, batch.atom_ids, batch.batch)]
    pos, cell, ids, system = plain  # a ShardTensor's local rows: the ids name the atoms
    first, second = pairs.edge_index
    offsets = torch.einsum("ei,eij->ej", pairs.unit_shifts.to(pos.dtype), cell.index_select(0, system[second]))
    lengths = (pos[second] + offsets - pos[first]).norm(dim=1)
    close = torch.nonzero(lengths < distance).flatten()
    if close.numel() == 0:
        return
    e = int(close[0])
    i, j, d = int(first[e]), int(second[e]), float(lengths[e])
    image = "" if not bool(pairs.unit_shifts[e].any()) else " (a periodic image)"
    more = f"; {close.numel()} such pairs in all" if close.numel() > 1 else ""
    raise InputError(
        f"atoms {int(ids[i])} and {int(ids[j])}{image} overlap: {d:.3g} A apart, closer than "
        f"{distance} A{more}. The structure has an atom placed twice; remove the duplicate "
        "(ase.geometry.get_duplicate_atoms(atoms, delete=True)) or fix how it was built"
    )


def _host_geometry(batch: Batch) -> Batch:
    """The positions, cells and ids of ``batch`` on the CPU. The overlap test's list is built
    there: on an H200, vesin's CUDA path had not returned a 0.01 A list of 1M atoms after 189 s,
    while its CPU path takes about 2 s (the radius, far below the atom spacing, is the outlier)."""
    def host(t):
        return t.detach().as_subclass(torch.Tensor).cpu()

    return Batch({k: host(batch.node[k]) for k in ("positions", "batch", "atom_ids")},
                 {k: host(batch.system[k]) for k in ("cell", "pbc")})


def check_inside_box(batch: Batch, tol: float = 1e-9) -> None:
    """Raise when an atom lies outside its cell along a non-periodic axis.

    Only matters where the cell is used to split space (domain decomposition); a
    non-periodic axis with a zero cell vector is rejected there by the strategy.
    """
    frac = fractional(batch)
    outside = (~batch.pbc[batch.batch]) & ((frac < -tol) | (frac >= 1 + tol))
    if outside.any():
        atom, axis = (int(x) for x in torch.nonzero(outside)[0])
        raise InputError(
            f"atom {int(batch.atom_ids[atom])} lies outside the box along non-periodic axis "
            f"{'xyz'[axis]} (fractional coordinate {float(frac[atom, axis]):.4f}); enlarge the cell "
            "along that axis (add vacuum) or center the system in it"
        )


def fractional(batch: Batch) -> torch.Tensor:
    """Fractional coordinates of every atom in its own system's cell."""
    inv = torch.linalg.inv(batch.cell)
    return torch.einsum("ni,nij->nj", batch.positions, inv[batch.batch])
