"""A replicated table read by a uniform index, and its adjoint (NOTE [a uniform index of rows]).

matgl's TensorNet reads its cell per atom by a system index built from a size
(``lattice[node_batch]``, ``node_batch = torch.zeros(n, dtype=long)``); the gradient of that read
is an ``index_put(accumulate=True)`` of atom rows into the (1, 3, 3) table by the plain index,
refused once ("a scatter by a plain index"). Every row's index is the same, so the scatter is a
sum over the rows: exact at 2/3/4 ranks, halo and sharded. A plain index whose rows differ stays
refused, by name.
"""

from __future__ import annotations

import functools

import pytest
import torch
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.models.lj import LennardJones
from mlipdd.testing import RankFailure, run_ranks
from mlipdd.testing.conformance import cases_off
from mlipdd.testing.systems import slab, small_cell, triclinic


class CellPerAtom(LennardJones):
    """LJ plus a per-atom term of the positions in the cell read per atom by an index built from
    a size (``uniform``), or by one that differs between rows (``alternating``)."""

    def __init__(self, index: str):
        super().__init__(epsilon=0.0123, sigma=2.5, cutoff=5.0)
        self.index = index

    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        n = positions.shape[0]
        if self.index == "uniform":
            node_batch = torch.zeros(n, dtype=torch.long)
            table = cell
        else:
            node_batch = torch.arange(n) % 2
            table = torch.cat([cell, 2 * cell])
        lattice = table[node_batch]  # (n, 3, 3)
        frac_like = (positions.unsqueeze(2) * lattice).sum(1)
        return energies + 1e-4 * torch.sin(frac_like).sum(1)


SYSTEMS = {"triclinic": lambda: triclinic(spacing=3.0, reps=4), "small_cell": lambda: small_cell(spacing=3.0, reps=3),
           "slab": lambda: slab(spacing=3.0)}


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
@pytest.mark.parametrize("strategy", ["halo", "sharded"])
def test_the_gradient_of_a_table_read_by_a_uniform_index_is_exact(world_size, strategy):
    names = list(SYSTEMS)
    cases = [(functools.partial(CellPerAtom, "uniform"), SYSTEMS[name](), {"strategy": strategy}) for name in names]
    assert cases_off(cases, names, world_size) == {}


def _alternating_worker(rank, world_size):
    dm = DistributedModel(CellPerAtom("alternating"), DomainConfig(cutoff=5.0))
    dm(dm.partition(triclinic(spacing=3.0, reps=4) if rank == 0 else None), compute_stress=True)


def test_a_plain_index_whose_rows_differ_is_refused_on_every_rank():
    with pytest.raises(RankFailure, match=r"refuses.*Fix:") as failure:
        run_ranks(_alternating_worker, 2)
    assert str(failure.value).count("AtenRefusal") >= 2
