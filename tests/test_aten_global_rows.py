"""One row by its one-process number, and atom rows kept by a mask, under the aten dispatch
(NOTE [a row by its global number], NOTE [atom rows kept by a mask] in
`mlipdd.shard.aten.global_rows`).

`RowReads` counts its systems as schnetpack's Atomwise does (``int(idx_m[-1]) + 1``), reads
the whole system's last and first atoms (``x[-1]``, ``x[0]``, ``x.select(0, -2)``) and the
atoms of one element (``z[z == 8]``, ``positions.detach()[mask]``); each read scales the
energy, so a wrong row is a wrong energy and wrong forces. At 2/3/4 gloo ranks, halo and
sharded storage, float64, a triclinic cell, a cell where a rank sees its own images, a slab
with vacuum cut along it (at 4 ranks some own no atom) and a batch of two systems: energy,
forces and stress equal one process to 1e-10. What cannot be exact is refused on every rank,
naming the op and the fix.
"""

from __future__ import annotations

import pytest
import torch
from mlipdd.spec.presets import SPEC_MPNN_HALO, SPEC_MPNN_SHARDED
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import check_conformance_cases, distributed_outputs
from mlipdd.testing.ordinary_models import DegreeMPNN
from mlipdd.testing.systems import slab, small_cell, triclinic, two_systems

SPECIES = (1, 8)
SPECS = {"halo": SPEC_MPNN_HALO, "sharded": SPEC_MPNN_SHARDED}


class RowReads(DegreeMPNN):
    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        z = batch.atomic_numbers
        n_systems = int(batch.batch[-1]) + 1  # schnetpack's Atomwise
        fixed = positions.detach()
        last, first, second_last = fixed[-1], fixed[0], fixed.select(0, -2)
        oxygens = z[z == 8]  # an element check's selection: replicated, in id order
        picked = fixed[z == 8]
        scale = (1.0 + 0.01 * n_systems + 1e-3 * (last.sum() - first[1] + 2.0 * second_last[2])
                 + 2e-3 * float(z[-1]) + 1e-4 * oxygens.numel() + 1e-5 * (picked * torch.arange(
                     1.0, picked.shape[0] + 1, dtype=picked.dtype).unsqueeze(1)).sum())
        return energies * scale


SYSTEMS = {
    "triclinic": lambda: triclinic(species=SPECIES, spacing=3.0, reps=4),
    "own_images": lambda: small_cell(species=SPECIES, spacing=2.6, reps=3),
    "slab_with_vacuum": lambda: slab(species=SPECIES, spacing=3.0, reps=(3, 3, 2), vacuum=14.0),
    "two_systems": lambda: two_systems(species=SPECIES, spacing=3.0),
}


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_rows_read_by_number_and_by_mask_equal_one_process(world_size):
    cases = [(RowReads, make(), {"strategy": strategy, **({"grid": (1, 1, world_size)} if name.startswith("slab")
                                                          else {})})
             for strategy in SPECS for name, make in SYSTEMS.items()]
    for result, _ in check_conformance_cases(cases, world_size):
        result.assert_close(energy=1e-10, forces=1e-10, stress=1e-10)


class _LocalSizeAsPosition(DegreeMPNN):
    """``x[x.shape[0] - 1]``: this rank's last row, not the system's."""

    def atomic_energies(self, batch, positions, cell):
        fixed = positions.detach()
        return super().atomic_energies(batch, positions, cell) * (1.0 + 1e-3 * fixed[fixed.shape[0] - 1].sum())


class _RowWithGradient(DegreeMPNN):
    """``positions[-1]`` with its gradient: refused (its adjoint would be this rank's row)."""

    def atomic_energies(self, batch, positions, cell):
        return super().atomic_energies(batch, positions, cell) + 1e-3 * positions[-1].sum()


class _MaskWithGradient(DegreeMPNN):
    def atomic_energies(self, batch, positions, cell):
        z = batch.atomic_numbers
        return super().atomic_energies(batch, positions, cell) + 1e-3 * positions[z == 8].sum()


def _refusal(rank, world_size, factory, strategy):
    try:
        distributed_outputs(rank, world_size, factory, triclinic(species=SPECIES, spacing=3.0, reps=4),
                            {"strategy": strategy}, False, SPECS[strategy])
    except Exception as error:  # noqa: BLE001 - its own refusal, or the first rank's relayed
        return str(error)
    return None


REFUSED = {
    _LocalSizeAsPosition: ("aten::select.int", ("differs between the ranks", "local row count"), "x[-1]"),
    _RowWithGradient: ("aten::select.int", ("carry a gradient",), "x.detach()[i]"),
    _MaskWithGradient: ("aten::index.Tensor", ("carry a gradient",), "torch.where(mask, x, 0)"),
}


@pytest.mark.parametrize("strategy", list(SPECS))
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_read_that_cannot_be_exact_is_refused_on_every_rank(world_size, strategy):
    for factory, (op, whys, fix) in REFUSED.items():
        for message in run_ranks(_refusal, world_size, factory, strategy):
            assert message is not None and f"refuses `{op}" in message, (factory.__name__, message)
            assert any(why in message for why in whys) and "Fix:" in message and fix in message, message
