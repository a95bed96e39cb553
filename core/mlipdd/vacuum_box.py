"""A box for molecules and clusters that come without one.

One process needs no cell for a system periodic on no axis; spatial decomposition does:
it splits the box among the ranks. `box_open_systems` gives each such system an
orthorhombic box around its atoms with ``vacuum`` Angstrom on every side, and moves the
atoms into it (a translation: energies and forces are unchanged, positions shift). The
box stays non-periodic, so no atom ever sees an image; the vacuum only keeps atoms that
move inside the box the ranks split. The CLI applies it whatever the number of ranks
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
    """Periodic on no axis, and the cell is degenerate (a zero or flat cell) or does not
    hold every atom: nothing a decomposition could split."""
    if bool(batch.pbc[system].any()):
        return False
    cell = batch.cell[system].detach()
    if float(torch.linalg.det(cell).abs()) < 1e-9:
        return True
    mine = batch.batch == system
    frac = batch.positions[mine].detach() @ torch.linalg.inv(cell)
    return bool(((frac < 0) | (frac >= 1)).any())


def box_open_systems(batch: Batch, vacuum: float) -> list[BoxedSystem]:
    """In place: each system `needs_box` gets a box with ``vacuum`` on every side; returns
    what was done (empty when every system already had a usable box)."""
    done = []
    cell = batch.cell.detach().clone()
    positions = batch.positions.detach().clone()
    for s in range(batch.num_systems):
        if not needs_box(batch, s):
            continue
        mine = batch.batch == s
        low = positions[mine].min(dim=0).values
        high = positions[mine].max(dim=0).values
        lengths = (high - low) + 2.0 * float(vacuum)
        shift = float(vacuum) - low
        positions[mine] = positions[mine] + shift
        cell[s] = torch.diag(lengths)
        done.append(BoxedSystem(s, tuple(float(x) for x in lengths), shift))
    if done:
        batch.node["positions"] = positions
        batch.cell = cell
    return done


def boxed_message(boxed: list[BoxedSystem], vacuum: float) -> str:
    """One line saying what `box_open_systems` did."""
    boxes = "; ".join(
        f"system {b.system}: {' x '.join(f'{x:.1f}' for x in b.lengths)} A" for b in boxed
    )
    return (f"no periodic box given: put in a non-periodic box with {vacuum:g} A of vacuum on "
            f"each side ({boxes}); positions shifted into it")
