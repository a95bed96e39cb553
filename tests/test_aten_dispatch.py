"""The aten-level dispatch: one process vs spawned ranks.

LJ (the reference model) under halo storage at 1-4 gloo ranks, float64: a triclinic
cell, a cell so small that a rank sees its own images, a slab cut along its vacuum and
a batch of two systems; energy, forces and stress to 1e-10 relative; an op without a rule is refused by name, and so are an order of atom row numbers and a
re-declaration of rows (NOTE [declared rows]).
"""

from __future__ import annotations

import pytest
import torch
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.models.lj import LennardJones
from mlipdd.shard import as_atom_rows
from mlipdd.shard.aten import AtenRefusal, ShardTensor, declare_row_local
from mlipdd.shard.aten.row_local import USER_ROW_LOCAL
from mlipdd.shard.aten.rules import default_fix
from mlipdd.testing.conformance import check_conformance_cases
from mlipdd.testing.systems import slab, small_cell, triclinic, two_systems
from mlipdd.testing.toy_models import ToyMPNN

ATEN = {"strategy": "halo"}


def lj():
    return LennardJones(epsilon={18: 0.0104, 10: 0.0031}, sigma={18: 3.4, 10: 2.75}, cutoff=7.0)


def systems():
    return {
        "triclinic": triclinic(species=(18, 10), reps=4),
        "own_images": small_cell(species=(18, 10), reps=2),
        "slab": slab(species=(18, 10), reps=(4, 4, 3)),
        "two_systems": two_systems(species=(18, 10)),
    }


@pytest.mark.mlipdd_conformance(world_sizes=(1, 2, 3, 4))
def test_lj_exact_under_aten_dispatch(world_size):
    cases = [(lj, batch, {**ATEN, **({"grid": (1, 1, world_size)} if name == "slab" else {})})
             for name, batch in systems().items()]
    for (result, _), name in zip(check_conformance_cases(cases, world_size), systems()):
        assert result.rel_diff["energy"] < 1e-10, (name, result.rel_diff)
        assert result.rel_diff["forces"] < 1e-10, (name, result.rel_diff)
        assert result.rel_diff["stress"] < 1e-10, (name, result.rel_diff)


def checked_at_one_rank(dm):
    """The rules at one process (NOTE [aten at one rank]: one rank hands plain tensors)."""
    dm.strategy.rows_at_one_rank = True
    return dm


def test_one_rank_hands_plain_tensors_and_equals_the_model():
    model = SortsAtoms(epsilon=0.0104, sigma=3.4, cutoff=7.0)  # refused at several ranks; exact at one
    batch = triclinic(species=(18,), reps=3)
    dm = DistributedModel(model, DomainConfig(cutoff=7.0, skin=0.5, **ATEN))
    out = dm(dm.partition(batch.clone()), compute_stress=True)
    assert not isinstance(dm.last_padded.positions, ShardTensor)
    reference = model(batch, compute_stress=True)
    for name in ("energy", "forces", "stress"):
        assert torch.allclose(out[name], reference[name], rtol=1e-12, atol=1e-14), name


class SortsAtoms(LennardJones):
    """An op without a rule on atom rows (a sort of per-atom energies)."""

    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        return torch.sort(energies).values


def test_an_op_without_a_rule_is_refused_by_name():
    model = SortsAtoms(epsilon=0.0104, sigma=3.4, cutoff=7.0)
    dm = checked_at_one_rank(DistributedModel(model, DomainConfig(cutoff=7.0, **ATEN)))
    owned = dm.partition(triclinic(reps=3))
    with pytest.raises(AtenRefusal, match=r"aten::sort.*from `aten::index_add`.*Fix:"):
        dm(owned)


def test_a_declared_row_local_op_runs():
    op = torch.ops.aten.rad2deg
    assert op not in USER_ROW_LOCAL

    class Rad2deg(LennardJones):
        def atomic_energies(self, batch, positions, cell):
            return torch.rad2deg(super().atomic_energies(batch, positions, cell))

    model = Rad2deg(epsilon=0.0104, sigma=3.4, cutoff=7.0)
    batch = triclinic(reps=3)
    dm = checked_at_one_rank(DistributedModel(model, DomainConfig(cutoff=7.0, **ATEN)))
    owned = dm.partition(batch)
    with pytest.raises(AtenRefusal, match="aten::rad2deg"):
        dm(owned)
    declare_row_local("aten::rad2deg")
    try:
        out = dm(owned)
    finally:
        USER_ROW_LOCAL.discard(op)
    reference = model(batch)
    assert torch.allclose(out["energy"], reference["energy"], rtol=1e-12)


class OverwritesRows(LennardJones):
    """Writes atom energies by an index (``scatter``, not ``scatter_add``): no cross-rank rule."""

    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        return energies.scatter(0, batch.batch, energies)


def test_the_fix_of_a_refusal_depends_on_the_kind_of_op():
    """NOTE [the fix a refusal names]: declare_row_local is suggested for an elementwise op only."""
    dm = checked_at_one_rank(DistributedModel(OverwritesRows(epsilon=0.0104, sigma=3.4, cutoff=7.0),
                                              DomainConfig(cutoff=7.0, **ATEN)))
    with pytest.raises(AtenRefusal, match="aten::scatter") as refused:
        dm(dm.partition(triclinic(reps=3)))
    assert "declare_row_local" not in str(refused.value) and "scatter_add" in str(refused.value)
    aten = torch.ops.aten
    assert "declare_row_local('aten::rad2deg')" in default_fix(aten.rad2deg.default)
    for op in (aten.scatter_.src, aten.index_copy.default, aten.cumsum.default, aten.mul.Tensor, aten.sum.default):
        assert "declare_row_local" not in default_fix(op), op  # not elementwise, or row-local / ruled already


class ComparesRows(LennardJones):
    """Compares the edge index's rows: ``!=`` is a row test (exact), ``<`` an order of local
    row numbers (refused); ``declare``: re-declares atom rows as atom rows (refused)."""

    compare = "ne"

    def atomic_energies(self, batch, positions, cell):
        sender, receiver = self.neighbors_for(batch).edge_index
        energies = super().atomic_energies(batch, positions, cell)
        if self.compare == "declare":
            return as_atom_rows(energies, positions)
        distinct = sender != receiver if self.compare == "ne" else sender < receiver
        return energies * distinct.any().to(energies.dtype)


def test_a_row_test_of_atom_row_numbers_runs_and_an_order_is_refused():
    model = ComparesRows(epsilon=0.0104, sigma=3.4, cutoff=7.0)
    batch = triclinic(reps=3)
    dm = checked_at_one_rank(DistributedModel(model, DomainConfig(cutoff=7.0, **ATEN)))
    owned = dm.partition(batch)
    assert torch.allclose(dm(owned)["energy"], LennardJones(epsilon=0.0104, sigma=3.4, cutoff=7.0)(batch)["energy"],
                          rtol=1e-12)
    model.compare = "lt"
    with pytest.raises(AtenRefusal, match=r"aten::lt.*atom row NUMBERS.*Fix:"):
        dm(owned)
    model.compare = "declare"
    with pytest.raises(AtenRefusal, match=r"as_atom_rows of a tensor that already holds rows.*Fix:"):
        dm(owned)


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_toy_mpnn_exact_under_aten_dispatch(world_size):
    cases = [(ToyMPNN, batch, ATEN) for batch in (triclinic(reps=4), small_cell(reps=2))]
    for result, _ in check_conformance_cases(cases, world_size):
        result.assert_close()


class TracesPerAtom(LennardJones):
    """TensorNet's ``X.diagonal(dim1=-1, dim2=-2)`` of a 3x3 per atom (matgl's decompose_tensor);
    ``across_rows``: a diagonal of the rows with the features instead."""

    across_rows = False

    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        outer = energies[:, None, None] * (1.0 + positions[:, :, None] * positions[:, None, :] * 1e-3)
        if self.across_rows:
            return energies + outer.reshape(-1, 9).diagonal(dim1=0, dim2=1).sum() * 0
        return outer.diagonal(offset=0, dim1=-1, dim2=-2).sum(-1)


def test_a_diagonal_of_other_dims_than_the_rows_is_row_local_across_them_refused():
    batch = triclinic(reps=3)
    model = TracesPerAtom(epsilon=0.0104, sigma=3.4, cutoff=7.0)
    dm = checked_at_one_rank(DistributedModel(model, DomainConfig(cutoff=7.0, **ATEN)))
    out = dm(dm.partition(batch.clone()), compute_stress=True)  # the diagonal and its backward
    reference = model(batch, compute_stress=True)
    for name in ("energy", "forces", "stress"):
        assert torch.allclose(out[name], reference[name], rtol=1e-12, atol=1e-14), name
    model.across_rows = True
    with pytest.raises(AtenRefusal, match="aten::diagonal.*across the row dimension"):
        dm(dm.partition(batch.clone()))


class NequIPSpellings(LennardJones):
    """Ops nequip's NequIP reaches with atom rows: ``torch.sinc`` (its Bessel basis), ``baddbmm``
    (its edge vectors, ``pos_diff + shift @ cell``) and a whole slice of the rows (``x[:n]``)."""

    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        shifted = torch.baddbmm(positions[:, None, :], positions[:, None, :], cell[batch.batch] * 1e-3)
        whole = shifted[: shifted.shape[0]].sum((1, 2))
        return energies * torch.sinc(whole * 1e-2)


def test_sinc_baddbmm_and_a_whole_slice_of_the_rows_are_exact():
    batch = triclinic(reps=3)
    model = NequIPSpellings(epsilon=0.0104, sigma=3.4, cutoff=7.0)
    dm = checked_at_one_rank(DistributedModel(model, DomainConfig(cutoff=7.0, **ATEN)))
    out = dm(dm.partition(batch.clone()), compute_stress=True)  # and their backwards (slice_backward)
    reference = model(batch, compute_stress=True)
    for name in ("energy", "forces", "stress"):
        assert torch.allclose(out[name], reference[name], rtol=1e-12, atol=1e-14), name
