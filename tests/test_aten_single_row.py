"""Ranks that own one atom or none under the aten dispatch (issue 21, NOTE [a single row]).

A rank owning one atom holds atom rows of size 1, which torch's einsum takes for a
broadcast dim; `EinsumMPNN` spells every product with einsum (rows kept, summed, an
ellipsis, three operands) and its stress runs the strain einsum too. One atom per rank
(a line of atoms, grid (N, 1, 1)) in a triclinic periodic cell, a cell so thin that an
atom sees its own images, and a slab with vacuum; halo and sharded storage; float64,
energy, forces and stress to 1e-10 relative at 2, 3 and 4 ranks.
"""

from __future__ import annotations

import pytest
import torch
from mlipdd.data import AtomicData, Batch
from mlipdd.shard.aten.one_row_einsum import one_row_einsum, parse
from mlipdd.testing.conformance import check_conformance_cases
from mlipdd.testing.ordinary_models import EinsumMPNN


def _line(n: int, thin: bool = False, vacuum: bool = False) -> Batch:
    """``n`` atoms along x, 3 A apart, in a sheared cell: one per rank at grid (n, 1, 1)."""
    side = 2.8 if thin else 7.0  # thin: below the cutoff, so an atom sees its own images
    cell = torch.tensor([[3.0 * n, 0.0, 0.0], [0.7, side, 0.0], [0.4, 0.5, side + (12.0 if vacuum else 0.0)]],
                        dtype=torch.float64)
    generator = torch.Generator().manual_seed(n)
    positions = torch.tensor([[1.0 + 3.0 * i, 1.0, 1.0] for i in range(n)], dtype=torch.float64)
    positions = positions + 0.2 * torch.rand(n, 3, generator=generator, dtype=torch.float64)
    numbers = [8 if i % 2 else 1 for i in range(n)]
    pbc = (True, True, not vacuum)
    return Batch.from_data_list([AtomicData(positions=positions, atomic_numbers=numbers, cell=cell, pbc=pbc)])


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_einsums_on_ranks_owning_one_atom_equal_one_process(world_size):
    cases = [(EinsumMPNN, _line(world_size, **shape), {"strategy": strategy, "grid": (world_size, 1, 1)})
             for strategy in ("sharded", "halo")
             for shape in ({}, {"thin": True}, {"vacuum": True})]
    for result, parts in check_conformance_cases(cases, world_size):
        result.assert_close(energy=1e-10)
        assert [len(p["atom_ids"]) for p in parts] == [1] * world_size  # every rank owns one atom


@pytest.mark.parametrize("equation, shapes", [
    ("ni,nij->nj", [(1, 3), (1, 3, 3)]),
    ("...ik,kc,bci,be->bc...", [(2, 5, 3, 4), (4, 6), (2, 6, 3), (2, 7)]),
    ("ni,i", [(1, 4), (4,)]),  # implicit output
    ("bi,bj,ijk->bk", [(1, 3), (1, 4), (3, 4, 5)]),
    ("...i,...i->...", [(2, 3, 4), (3, 4)]),  # ellipses of different widths
    ("ab,ab->ab", [(1, 3), (2, 3)]),  # a broadcast letter
    ("ij,nj->in", [(2, 3), (1, 3)]),
    ("nf,ng->fg", [(1, 4), (1, 5)]),
])
def test_the_shape_stable_spelling_equals_torch_einsum(equation, shapes):
    generator = torch.Generator().manual_seed(0)
    operands = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    terms, output = parse(equation, operands)
    torch.testing.assert_close(one_row_einsum(terms, output, operands), torch.einsum(equation, *operands),
                               rtol=1e-14, atol=1e-14)


def test_a_diagonal_is_left_to_torch():
    assert parse("ii->i", [torch.zeros(2, 2)]) is None
