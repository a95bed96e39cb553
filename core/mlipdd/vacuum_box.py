"""A box for molecules, clusters, slabs and wires that come without one.

One process needs no cell for a system periodic on no axis; spatial decomposition does:
it splits the box among the ranks. `box_open_systems` gives each such system a box around
its atoms with ``vacuum`` Angstrom on every side of its open directions (orthorhombic for
a molecule; a slab or wire keeps its periodic vectors and gains perpendicular ones), and
moves the atoms into it (a translation: energies and forces are unchanged, positions
shift). The added axes stay non-periodic, so no atom ever sees an image through them;
the vacuum only keeps atoms that move inside the box the ranks split. The CLI applies it whatever the number of ranks
(outputs must not depend on it) and says so; the ASE calculator can use the shift to
give positions back unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mlipdd.data import Batch


class BoxedSystem(NamedTuple):
    system: int
    lengths: tuple[float, float, float]  # Angstrom, the new box's edges
    shift: torch.Tensor  # [3]: added to every position of the system


def needs_box(batch: Batch, system: int) -> bool:
    """A non-periodic axis without a cell vector (a slab or wire given without vacuum), or,
    periodic on no axis, a cell that is degenerate or does not hold every atom: nothing a
    decomposition could split (and, for a slab, not even one process can run it)."""
    pbc = batch.pbc[system]
    cell = batch.cell[system].detach()
    zero = cell.norm(dim=1) == 0
    if bool(pbc.any()):
        return bool((zero & ~pbc).any())
    if float(torch.linalg.det(cell).abs()) < 1e-9:
        return True
    mine = batch.batch == system
    frac = batch.positions[mine].detach() @ torch.linalg.inv(cell)
    return bool(((frac < 0) | (frac >= 1)).any())


def box_open_systems(batch: Batch, vacuum: float) -> list[BoxedSystem]:
    """In place: each system `needs_box` gets a box with ``vacuum`` on every side of its
    open directions; returns what was done (empty when every system had a usable box).
    A molecule or cluster gets an orthorhombic box; a slab or wire keeps its periodic
    vectors and gains the missing ones, perpendicular to them."""
    done = []
    cell = batch.cell.detach().clone()
    positions = batch.positions.detach().clone()
    for s in range(batch.num_systems):
        if not needs_box(batch, s):
            continue
        mine = batch.batch == s
        periodic = batch.pbc[s]
        keep = periodic & (cell[s].norm(dim=1) > 0)  # vectors that stay as they are
        directions = _open_directions(cell[s], keep)
        shift = torch.zeros(3, dtype=cell.dtype, device=cell.device)
        for axis, direction in directions.items():
            along = positions[mine] @ direction
            length = float(along.max() - along.min()) + 2.0 * float(vacuum)
            cell[s, axis] = direction * length
            shift = shift + direction * (float(vacuum) - float(along.min()))
        positions[mine] = positions[mine] + shift
        done.append(BoxedSystem(s, tuple(float(x) for x in cell[s].norm(dim=1)), shift))
    if done:
        batch.node["positions"] = positions
        batch.cell = cell
    return done


def _open_directions(cell: torch.Tensor, keep: torch.Tensor) -> dict[int, torch.Tensor]:
    """Unit vectors for the axes not kept: the coordinate axes when none is kept, else
    perpendicular to the kept vectors (and to each other), oriented for a right-handed cell."""
    eye = torch.eye(3, dtype=cell.dtype, device=cell.device)
    kept = [int(a) for a in torch.nonzero(keep).flatten()]
    open_axes = [a for a in range(3) if a not in kept]
    if not kept:
        return {a: eye[a] for a in range(3)}
    basis = [cell[a] / cell[a].norm() for a in kept]
    if len(kept) == 1:  # a wire: a second direction perpendicular to it, then the third
        seed = eye[int(torch.argmin(basis[0].abs()))]
        first = seed - (seed @ basis[0]) * basis[0]
        basis.append(first / first.norm())
    normal = torch.linalg.cross(basis[0], basis[1])
    directions = basis[len(kept):] + [normal / normal.norm()]
    out = dict(zip(open_axes, directions))
    trial = cell.clone()
    for axis, direction in out.items():
        trial[axis] = direction
    if float(torch.linalg.det(trial)) < 0:  # flip the last open direction: right-handed
        out[open_axes[-1]] = -out[open_axes[-1]]
    return out


def boxed_message(boxed: list[BoxedSystem], vacuum: float) -> str:
    """One line saying what `box_open_systems` did."""
    boxes = "; ".join(
        f"system {b.system}: {' x '.join(f'{x:.1f}' for x in b.lengths)} A" for b in boxed
    )
    return (f"no periodic box given: put in a non-periodic box with {vacuum:g} A of vacuum on "
            f"each side ({boxes}); positions shifted into it")
