"""Which plain tensors a sharded forward treats as owned rows (NOTE [row counts]); one process."""

import pytest
import torch
from mlipdd.shard import ExchangePlan, Sharded, ShardMeta, ShardTensor
from mlipdd.shard.owned_rows import RowCount, UninferredRowsError, owned_rows_scope

N_OWNED, N_EDGES = 5, 9


@pytest.fixture
def positions():
    plan = ExchangePlan(torch.zeros(0, dtype=torch.long), (0,), (0,), N_OWNED)
    meta = ShardMeta(plan=plan, n_systems=1, n_edges=N_EDGES, layout=Sharded())
    return ShardTensor.wrap(torch.rand(N_OWNED, 3, dtype=torch.float64), meta)


def is_owned_rows(t) -> bool:
    return isinstance(t, ShardTensor) and t.meta.layout.is_sharded()


def test_the_atom_count_remembers_its_layout(positions):
    for n in (positions.shape[0], positions.size(0), positions.size()[0], positions.size(-2)):
        assert isinstance(n, RowCount) and n == N_OWNED
    assert not isinstance(positions.shape[1], RowCount)
    # arithmetic gives a count that no factory trusts (NOTE [counts are sizes]), int() a plain int
    assert not isinstance(positions.shape[0] + 0, RowCount) and type(int(positions.shape[0])) is int
    assert type(len(positions)) is int  # Python converts __len__'s result


def test_factories_given_the_count_make_owned_rows_inside_the_forward_only(positions):
    n = positions.shape[0]
    original = torch.zeros
    with owned_rows_scope(positions.meta):
        made = [torch.zeros(n, 4), torch.zeros((n, 4)), torch.ones(n), torch.empty(n, 2), torch.full((n,), 1.0),
                torch.randn(n, 2), torch.zeros(size=(n, 2)), torch.ones(4).new_zeros(n, 4),
                torch.ones(4).new_full((n,), 2.0), torch.ones(1, 4).expand(n, 4), torch.broadcast_to(torch.ones(4), (n, 4))]
        assert all(is_owned_rows(t) for t in made), [type(t) for t in made]
        # a size that only equals the count is not trusted, nor the count in a later dimension
        assert not isinstance(torch.zeros(int(n), 4), ShardTensor)
        assert not isinstance(torch.zeros(4, n), ShardTensor)
    assert torch.zeros is original  # torch's own factories outside the forward
    assert not isinstance(torch.zeros(n, 4), ShardTensor)


def test_a_remote_read_of_an_uninferred_tensor_names_where_it_was_made(positions):
    with pytest.raises(UninferredRowsError) as info, owned_rows_scope(positions.meta):
        state = torch.zeros(int(positions.shape[0]), 4)  # the layout-dropping mistake
        state[torch.tensor([0, N_OWNED + 2])]
    message = str(info.value)
    assert "test_owned_rows.py" in message and "state = torch.zeros(int(positions.shape[0]), 4)" in message
    assert "state[torch.tensor([0, N_OWNED + 2])]" in message and "zeros_like" in message


def test_a_scatter_into_remote_rows_of_an_uninferred_tensor_is_explained_too(positions):
    with pytest.raises(UninferredRowsError, match="zeros_like"), owned_rows_scope(positions.meta):
        state = torch.zeros(int(positions.shape[0]))
        state.index_add(0, torch.tensor([N_OWNED + 1]), torch.ones(1))


def test_other_errors_pass_through(positions):
    with pytest.raises(IndexError) as info, owned_rows_scope(positions.meta):
        torch.zeros(3)[7]
    assert not isinstance(info.value, UninferredRowsError)
