"""Gradients through `mlipdd.shard.local`: a model that computes a step on this rank's plain
rows gets exact forces and stress.

A ghost row of ``local(positions)`` is a copy of its owner's row: the gradient a plain pair term
sends into it is a share of the owner's force, and must be summed into the owner (it was
dropped once, silently: forces 3e-2 .. 0.3 off at 2 ranks). ``local(cell)`` of the strained
cell is refused on every rank: a rank's gradient of its copy is its part of the virial or the
whole one depending on the path it came by (summed or not, the stress was 50 % off).

A value reduced over local() rows is this rank's part of the whole: used as a replicated number
(``e * (1 + s)``, ``s = w.sum()`` or ``torch.zeros(n).index_add(0, receiver, w).sum()``) it was
15 % off at 2 ranks, silently; it is refused by name now, and its all_reduce is exact (NOTE
[rank-local values]).
"""

from __future__ import annotations

import functools

import pytest
import torch
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.models.lj import LennardJones
from mlipdd.shard import all_reduce_sum, as_atom_rows, local, process_group
from mlipdd.testing import RankFailure, run_ranks
from mlipdd.testing.conformance import cases_off
from mlipdd.testing.systems import slab, small_cell, triclinic


class PlainPairEnergy(LennardJones):
    """A Morse-like pair energy per receiver, computed on this rank's plain rows (``local``),
    declared back as atom rows; ``plain_cell``: the image shifts too are computed from
    ``local(cell)`` (else by the rules, from the distributed cell)."""

    def __init__(self, plain_cell: bool):
        super().__init__(epsilon=0.0123, sigma=2.5, cutoff=5.0)
        self.plain_cell = plain_cell

    def atomic_energies(self, batch, positions, cell):
        neighbors = self.neighbors_for(batch)
        if self.plain_cell:
            shifts = local(neighbors.unit_shifts).to(positions.dtype) @ local(cell)[0]
        else:
            shifts = local(neighbors.shifts(cell, batch.batch))
        sender, receiver = local(neighbors.edge_index)
        pos = local(positions)
        vectors = pos.index_select(0, receiver) + shifts - pos.index_select(0, sender)
        r = vectors.norm(dim=1)
        pair = torch.where(r < self.cutoff, (1 - torch.exp(-(r - 2.6))) ** 2 - 1, torch.zeros_like(r))
        z = local(batch.atomic_numbers)  # an integer per atom row read by the senders too
        pair = pair * (1 + 1e-3 * (z[sender] + 2 * z[receiver]).to(pair.dtype))
        energies = torch.zeros(pos.shape[0], dtype=pos.dtype).index_add(0, receiver, 0.5 * pair)
        return as_atom_rows(energies, positions, ghosts_current=False)


SYSTEMS = {"triclinic": lambda: triclinic(spacing=3.0, reps=4), "small_cell": lambda: small_cell(spacing=3.0, reps=3),
           "slab": lambda: slab(spacing=3.0)}


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
@pytest.mark.parametrize("strategy", ["halo", "sharded"])
def test_plain_pair_energy_on_local_rows_is_exact(world_size, strategy):
    # sharded storage: local(positions) is [owned | request table] (NOTE [local rows under sharded
    # storage]); it once held the owned rows only, which remote senders point past (an IndexError)
    names = list(SYSTEMS)
    cases = [(functools.partial(PlainPairEnergy, False), SYSTEMS[name](), {"strategy": strategy}) for name in names]
    assert cases_off(cases, names, world_size) == {}


def _local_cell_worker(rank, world_size):
    dm = DistributedModel(PlainPairEnergy(plain_cell=True), DomainConfig(cutoff=5.0))
    dm(dm.partition(triclinic(spacing=3.0, reps=4) if rank == 0 else None), compute_stress=True)


def test_local_of_the_strained_cell_is_refused_on_every_rank():
    with pytest.raises(RankFailure, match=r"local\(\) of a replicated tensor that carries a gradient.*Fix:") as failure:
        run_ranks(_local_cell_worker, 2)
    assert str(failure.value).count("AtenRefusal") >= 2


class LocalIndexTable(PlainPairEnergy):
    """local() of a declared neighbour table (values are atom row numbers)."""

    def atomic_energies(self, batch, positions, cell):
        sender, receiver = local(batch.neighbors.edge_index)
        n = local(positions).shape[0]
        table = as_atom_rows(torch.zeros(n, dtype=torch.long).index_put((receiver,), sender), positions,
                             ghosts_current=False, index=True)
        local(table)
        return super().atomic_energies(batch, positions, cell)


def _local_table_worker(rank, world_size):
    dm = DistributedModel(LocalIndexTable(plain_cell=False), DomainConfig(cutoff=5.0, strategy="sharded"))
    dm(dm.partition(triclinic(spacing=3.0, reps=4) if rank == 0 else None))


def test_local_of_an_index_table_under_sharded_storage_is_refused_on_every_rank():
    # its request-table rows would hold the owners' row numbers, not this rank's
    with pytest.raises(RankFailure, match=r"local\(\) of atom rows whose values are atom row numbers.*Fix:") as failure:
        run_ranks(_local_table_worker, 2)
    assert str(failure.value).count("AtenRefusal") >= 2


class LocalScalar(LennardJones):
    """LJ per atom scaled by a whole-system number computed on local() rows: ``plain_sum`` a
    plain sum, ``factory_sum`` a sum of a factory filled by the edge index, ``all_reduced``
    the plain sum all-reduced (the fix), ``undeclared`` per-atom energies of local() rows
    returned without as_atom_rows."""

    def __init__(self, how: str):
        super().__init__(epsilon=0.0123, sigma=2.5, cutoff=5.0)
        self.how = how

    def atomic_energies(self, batch, positions, cell):
        e = super().atomic_energies(batch, positions, cell)
        sender, receiver = local(batch.neighbors.edge_index)
        pos = local(positions)
        shifts = local(batch.neighbors.shifts(cell, batch.batch))
        r = (pos[receiver] + shifts - pos[sender]).norm(dim=1)
        w = torch.where(r < self.cutoff, torch.exp(-r), torch.zeros_like(r))
        per_atom = torch.zeros(pos.shape[0], dtype=pos.dtype).index_add(0, receiver, w)
        if self.how == "undeclared":
            return per_atom
        s = per_atom.sum() if self.how == "factory_sum" else w.sum()
        if self.how == "all_reduced":
            s = all_reduce_sum(s, process_group(positions))
        return e * (1 + 1e-2 * s)


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
@pytest.mark.parametrize("strategy", ["halo", "sharded"])
def test_an_all_reduced_sum_of_local_rows_is_exact(world_size, strategy):
    names = list(SYSTEMS)
    cases = [(functools.partial(LocalScalar, "all_reduced"), SYSTEMS[name](), {"strategy": strategy})
             for name in names]
    assert cases_off(cases, names, world_size) == {}


def _local_scalar_worker(rank, world_size, how, strategy):
    dm = DistributedModel(LocalScalar(how), DomainConfig(cutoff=5.0, strategy=strategy))
    dm(dm.partition(triclinic(spacing=3.0, reps=4) if rank == 0 else None), compute_stress=True)


@pytest.mark.parametrize("strategy", ["halo", "sharded"])
@pytest.mark.parametrize("how,message", [
    ("plain_sum", r"reduced over them.*Fix: compute the reduction on the distributed tensors"),
    ("factory_sum", r"reduced over them.*Fix: compute the reduction on the distributed tensors"),
    # halo: its energy is exact (the per-system sum reads the per-row values as rows), its gradient
    # reaches the plain graph as rows, refused at the plain index; sharded: its rows are
    # [owned | request table], refused at the per-system sum
    ("undeclared", r"mlipdd aten dispatch refuses .*Fix:"),
])
def test_a_value_reduced_over_local_rows_is_refused_on_every_rank(how, message, strategy):
    with pytest.raises(RankFailure, match=message) as failure:
        run_ranks(_local_scalar_worker, 2, how, strategy)
    assert str(failure.value).count("AtenRefusal") >= 2
