"""A replicated table read by a uniform index, and its adjoint (NOTE [a uniform index of rows]).

matgl's TensorNet reads its cell per atom by a system index built from a size
(``lattice[node_batch]``, ``node_batch = torch.zeros(n, dtype=long)``); the gradient of that read
is an ``index_put(accumulate=True)`` of atom rows into the (1, 3, 3) table by the plain index,
refused once ("a scatter by a plain index"). Every row's index is the same, so the scatter is a
sum over the rows: exact at 2/3/4 ranks, halo and sharded. So are orb's spellings of the same
one-system index: ``bmm(positions, displacement[per_node])`` and segment ids from the whole
system's counts expanded to the rows. A plain index whose rows differ stays refused, by name.
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
        if self.index != "alternating":
            node_batch = torch.zeros(n, dtype=torch.long)
            table = cell
        else:
            node_batch = torch.arange(n) % 2
            table = torch.cat([cell, 2 * cell])
        lattice = table[node_batch]  # (n, 3, 3)
        if self.index == "bmm":  # orb's strain displacement: bmm(positions, displacement[per_node])
            frac_like = torch.bmm(positions.unsqueeze(1), lattice).squeeze(1)
        else:
            frac_like = (positions.unsqueeze(2) * lattice).sum(1)
        energies = energies + 1e-4 * torch.sin(frac_like).sum(1)
        if self.index == "segments":  # orb's segment_sum: ids from the whole system's counts, expanded
            n_node = torch.bincount(batch.batch, minlength=batch.num_systems)
            ids = torch.repeat_interleave(torch.arange(batch.num_systems), n_node)
            h = torch.stack([energies, torch.cos(frac_like).sum(1)], 1)
            pooled = torch.zeros(batch.num_systems, 2, dtype=h.dtype).scatter_add(0, ids.view(-1, 1).expand_as(h), h)
            energies = energies * (1 + 1e-3 * pooled[batch.batch, 1])
        return energies


SYSTEMS = {"triclinic": lambda: triclinic(spacing=3.0, reps=4), "small_cell": lambda: small_cell(spacing=3.0, reps=3),
           "slab": lambda: slab(spacing=3.0)}


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
@pytest.mark.parametrize("strategy", ["halo", "sharded"])
def test_the_gradient_of_a_table_read_by_a_uniform_index_is_exact(world_size, strategy):
    # "bmm": a batch factor equal in every row (NOTE [a batch factor equal along the rows]);
    # "segments": whole-system segment ids expanded to this rank's rows (NOTE [an expand of equal rows])
    names = [f"{index}/{name}" for index in ("uniform", "bmm", "segments") for name in SYSTEMS]
    cases = [(functools.partial(CellPerAtom, name.split("/")[0]), SYSTEMS[name.split("/")[1]](), {"strategy": strategy})
             for name in names]
    assert cases_off(cases, names, world_size) == {}


def _alternating_worker(rank, world_size):
    dm = DistributedModel(CellPerAtom("alternating"), DomainConfig(cutoff=5.0))
    dm(dm.partition(triclinic(spacing=3.0, reps=4) if rank == 0 else None), compute_stress=True)


def test_a_plain_index_whose_rows_differ_is_refused_on_every_rank():
    with pytest.raises(RankFailure, match=r"refuses.*Fix:") as failure:
        run_ranks(_alternating_worker, 2)
    assert str(failure.value).count("AtenRefusal") >= 2
