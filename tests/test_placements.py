"""Placements (NOTE [placements] in mlipdd.shard.placement) and refuse-by-default (NOTE
[refuse by default] in mlipdd.shard.propagation), in process on a one-rank layout (no
collective needs a group there): where each op family puts the rows, that a reduction
over the rows is recognised whatever dim they are on, that ops which scramble rows make
them opaque, and that an op with no rule on rows is refused with its name and the fix.
The spawned-rank checks of whole models are the idiom zoo's (tests/test_idiom_zoo.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mlipdd.shard import (
    ExchangePlan,
    Halo,
    NoRuleError,
    Rows,
    Sharded,
    ShardMeta,
    ShardTensor,
    placement_of,
)
from mlipdd.shard.placement import ATOMS, EDGES

N_OWNED, N_GHOST, N_EDGES, N_SYSTEMS = 5, 3, 11, 2


def meta_for(layout) -> ShardMeta:
    plan = ExchangePlan(torch.zeros(N_GHOST, dtype=torch.long), (N_GHOST,), (N_GHOST,), N_OWNED)
    return ShardMeta(plan=plan, n_systems=N_SYSTEMS, n_edges=N_EDGES, layout=layout)


@pytest.fixture(params=[Halo(), Sharded()], ids=["halo", "sharded"])
def meta(request):
    return meta_for(request.param)


def atoms(meta, *features):
    values = torch.randn(meta.n_padded, *features, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return ShardTensor.wrap(values, meta, ATOMS)


def test_row_local_ops_keep_the_rows_where_they_move(meta):
    x = atoms(meta, 3, 4)
    assert placement_of(F.silu(x) * 2 + 1) == ATOMS
    assert placement_of(x.sum(-1)) == ATOMS and placement_of(x.sum(1, keepdim=True)) == ATOMS
    assert placement_of(x.transpose(0, 2)) == Rows("atoms", dim=2)
    assert placement_of(x.permute(1, 0, 2)) == Rows("atoms", dim=1)
    assert placement_of(x.flatten()) == Rows("atoms", dim=0, group=12)
    assert placement_of(x.reshape(meta.n_padded, -1)) == ATOMS
    assert placement_of(x.flatten().view(-1, 3, 4)) == ATOMS
    assert placement_of(x.unsqueeze(0)) == Rows("atoms", dim=1)
    assert placement_of(torch.stack([x, x], dim=0)) == Rows("atoms", dim=1)
    assert placement_of(torch.einsum("nij,jk->kin", x, torch.ones(4, 2, dtype=x.dtype))) == Rows("atoms", dim=2)
    assert placement_of(x @ torch.ones(4, 2, dtype=x.dtype)) == ATOMS
    assert placement_of(x[:, 0]) == ATOMS and placement_of(x[..., 1:]) == ATOMS


def test_one_hot_of_given_width_keeps_the_rows_an_inferred_width_is_refused(meta):
    """orb's and sevenn's species embeddings: ``one_hot(z, num_classes)`` encodes each row on
    its own; without ``num_classes`` the width is this rank's largest value + 1."""
    z = ShardTensor.wrap(torch.arange(meta.n_padded) % 3, meta, ATOMS)
    assert placement_of(F.one_hot(z, num_classes=5)) == ATOMS and placement_of(F.one_hot(z, 5)) == ATOMS
    with pytest.raises(NoRuleError, match="(?s)one_hot.*num_classes inferred"):
        F.one_hot(z)


def test_a_diagonal_of_other_dims_keeps_the_rows_one_across_them_is_refused(meta):
    x = atoms(meta, 3, 3)  # TensorNet's trace per atom or edge
    assert placement_of(x.diagonal(dim1=-1, dim2=-2)) == ATOMS
    assert placement_of(torch.diagonal(x.transpose(0, 1), 0, 0, 2)) == Rows("atoms", dim=0)
    with pytest.raises(NoRuleError, match="diagonal across the rows"):
        x.diagonal(dim1=0, dim2=1)


def test_baddbmm_with_the_rows_the_batch_of_all_three_keeps_them(meta):
    x = atoms(meta, 1, 3)  # nequip's per-edge ``baddbmm(pos_diff, shift, cell[edge_batch])``
    m = atoms(meta, 3, 3)
    assert placement_of(torch.baddbmm(x, x, m)) == ATOMS
    assert placement_of(torch.baddbmm(torch.zeros(1, 1, 3, dtype=x.dtype), x, m)) == ATOMS
    with pytest.raises(NoRuleError, match="baddbmm"):
        torch.baddbmm(x, x, torch.ones(meta.n_padded, 3, 3, dtype=x.dtype))


def test_ops_that_scramble_rows_make_them_opaque(meta):
    x = atoms(meta, 3)
    for scrambled in (x[0], x[1:], x.flatten()[3:].reshape(-1, 3), torch.cat([x, x])):
        assert placement_of(scrambled).is_opaque()
    with pytest.raises(NoRuleError, match="reduces over the rows"):
        x[1:].sum()  # which atoms those are depends on the rank


@pytest.mark.parametrize("op", [lambda x: torch.cumsum(x, 0), lambda x: torch.cov(x.T),
                                lambda x: torch.sort(x, dim=0), lambda x: x.squeeze() if x.shape[0] == 1 else
                                torch.segment_reduce(x, "sum", lengths=torch.tensor([x.shape[0]]))])
def test_an_op_without_a_rule_on_rows_is_refused_with_its_name_and_the_fix(meta, op):
    with pytest.raises(NoRuleError, match=r"(?s)`.+`.*(declare_row_local|Fixes)"):
        op(atoms(meta, 3))


def test_a_declared_row_local_op_keeps_the_rows(meta):
    from mlipdd.shard import declare_row_local
    from mlipdd.shard.propagation import PROPAGATE

    def my_activation(x):
        return torch.tanh(x) * x

    op = torch.special.log1p
    saved = PROPAGATE.pop(op)
    try:
        with pytest.raises(NoRuleError, match="log1p"):
            op(atoms(meta, 2))
        declare_row_local(op)
        assert placement_of(op(atoms(meta, 2))) == ATOMS
    finally:
        PROPAGATE[op] = saved
    assert placement_of(my_activation(atoms(meta, 2))) == ATOMS  # plain torch inside: no declaration needed


def test_reductions_over_rows_on_any_dim_equal_the_whole_reduction():
    # one rank and no ghost rows: the whole reduction is the reduction of the local rows
    plan = ExchangePlan(torch.zeros(0, dtype=torch.long), (0,), (0,), N_OWNED)
    meta = ShardMeta(plan=plan, n_systems=1, n_edges=N_EDGES, layout=Halo())
    x = atoms(meta, 3)
    plain = x.local()
    for got, want in ((x.t().mean(1), plain.mean(0)), (x.flatten().mean(), plain.mean()),
                      (x.T.sum(-1), plain.sum(0)), (torch.stack([x, 2 * x]).sum(), 3 * plain.sum()),
                      (x.flatten().amax(), plain.amax()), (x.t().std(1), plain.std(0))):
        assert got.meta.layout.is_replicated() and torch.allclose(got.local(), want)


def test_a_scatter_by_a_system_index_is_per_system_whatever_the_row_counts():
    """A rank with as many atom rows as systems (issue 25, item 0): the index says which."""
    plan = ExchangePlan(torch.zeros(0, dtype=torch.long), (0,), (0,), 2)
    meta = ShardMeta(plan=plan, n_systems=2, n_edges=3, layout=Halo())
    from mlipdd.shard import registry
    from mlipdd.shard.placement import SYSTEM_INDEX

    system = ShardTensor.wrap(torch.tensor([0, 1]), meta, SYSTEM_INDEX)
    energies = atoms(meta)
    rule = registry.lookup(torch.Tensor.index_add, meta, (torch.zeros(2, dtype=torch.float64), 0, system,
                                                         energies), {})
    assert rule.name == "per_system_reduce"
    receiver = ShardTensor.wrap(torch.tensor([0, 1, 1]), meta, EDGES)
    rule = registry.lookup(torch.Tensor.index_add, meta, (torch.zeros(2, dtype=torch.float64), 0, receiver,
                                                         ShardTensor.wrap(torch.ones(3), meta, EDGES)), {})
    assert rule.name == "halo_scatter"
