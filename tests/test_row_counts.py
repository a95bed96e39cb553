"""Row counts are sizes, never values (NOTE [counts are sizes]); scripted functions run
under the dispatch (NOTE [scripted functions]). One process, ShardTensors built by hand."""

import dataclasses
import math

import pytest
import torch
from mlipdd.shard import ExchangePlan, NoRuleError, ShardMeta, ShardTensor
from mlipdd.shard.counts import LocalCount, LocalRatio
from mlipdd.shard.layouts import HALO, Halo, Sharded
from mlipdd.shard.placement import ATOMS, EDGES
from mlipdd.shard.scripted import script_functions_dispatched

N_OWNED, N_GHOST, N_EDGES = 4, 3, 11


def _meta(layout):
    plan = ExchangePlan(torch.zeros(N_GHOST, dtype=torch.long), (0, N_GHOST), (0, N_GHOST), N_OWNED)
    return ShardMeta(plan=plan, n_systems=1, n_edges=N_EDGES, layout=layout)


@pytest.fixture(params=["halo", "sharded"])
def rows(request):
    meta = _meta(HALO if request.param == "halo" else Sharded())
    n = meta.n_padded
    h = ShardTensor.wrap(torch.rand(n, 5, dtype=torch.float64), meta, ATOMS)
    e = ShardTensor.wrap(torch.rand(N_EDGES, 5, dtype=torch.float64), meta, EDGES)
    return h, e


def test_the_rows_dimension_is_a_count_and_the_features_are_plain(rows):
    h, e = rows
    assert isinstance(h.shape[0], LocalCount) and isinstance(h.size(0), LocalCount)
    assert isinstance(e.size()[-2], LocalCount)
    assert type(h.shape[1]) is int and type(h.t().shape[0]) is int and isinstance(h.t().shape[1], LocalCount)
    assert isinstance(e.shape[0] / h.shape[0], LocalRatio) and isinstance(2 * e.shape[0] - 1, LocalCount)
    assert isinstance(h.shape[0] * 0.5, LocalRatio) and isinstance(1 / h.shape[0], LocalRatio)


def test_a_count_as_a_size_or_an_integer_index_is_allowed(rows):
    h, _ = rows
    n = h.shape[0]
    assert h.new_zeros(n, 2).shape == (n, 2) and h.reshape(n, 5).shape == h.shape
    ids = torch.arange(N_EDGES)
    pair = ShardTensor.wrap(ids, h.meta, EDGES) * n + 1  # a rank-local index structure
    assert pair.dtype == torch.long
    assert torch.equal(h / h.shape[1], h.local() / 5)  # a feature width is a plain number


@pytest.mark.parametrize("spell", [
    lambda h, e: h / (e.shape[0] / h.shape[0]),  # the average degree from tensor sizes
    lambda h, e: h * (1 / h.shape[0]),
    lambda h, e: h.sum(1) / h.shape[0],
    lambda h, e: torch.div(e, e.shape[0]),
    lambda h, e: h.pow(h.shape[0] - 1),
])
def test_a_count_as_a_value_next_to_rows_is_refused_naming_its_origin(rows, spell):
    h, e = rows
    with pytest.raises(NoRuleError, match=r"row count \(`Tensor\.(shape|size)` of (atom|edge) rows"):
        spell(h, e)


@pytest.mark.parametrize("spell", [
    lambda h, e: h / math.sqrt(h.shape[0]),  # 1/sqrt(N) normalisation
    lambda h, e: h * float(e.shape[0] / h.shape[0]),
    lambda h, e: torch.full_like(h, float(h.shape[0])),
])
def test_a_count_made_a_float_is_refused_naming_its_origin(rows, spell):
    h, e = rows
    with pytest.raises(NoRuleError, match=r"`float\(\)` \(or a math function\) uses the number .* row count"):
        spell(h, e)


def test_a_division_by_a_rank_without_atoms_is_refused_not_a_zero_division():
    """A rank that owns no atom has a count of 0: the division is the count used as a value."""
    meta = _meta(Sharded())
    plan = dataclasses.replace(meta.plan, n_owned=0)
    empty = ShardTensor.wrap(torch.rand(0, 5, dtype=torch.float64), dataclasses.replace(meta, plan=plan), ATOMS)
    with pytest.raises(NoRuleError, match=r"division by zero.*row count \(`Tensor\.shape` of atom rows"):
        N_EDGES / empty.shape[0]


@torch.jit.script
def _scripted_sum(src: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros([n, src.shape[1]], dtype=src.dtype).index_add(0, index, src)


class _Block(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_a_script_function_runs_its_python_under_the_dispatch_inside_the_scope_only():
    meta = _meta(Halo(correct_scatters=False))  # its scatter stays local: no process group needed
    src = ShardTensor.wrap(torch.rand(N_EDGES, 2, dtype=torch.float64), meta, EDGES)
    index = torch.randint(0, N_OWNED, (N_EDGES,))
    expected = torch.zeros(meta.n_padded, 2, dtype=torch.float64).index_add(0, index, src.local())
    assert type(_scripted_sum(src, index, meta.n_padded)) is torch.Tensor  # TorchScript: no dispatch
    original = torch.jit.ScriptFunction.__call__
    with script_functions_dispatched():
        assert type(_scripted_sum(src.local(), index, meta.n_padded)) is torch.Tensor  # plain in: TorchScript
        out = _scripted_sum(src, index, meta.n_padded)  # rows in: its Python, every op dispatched
        assert isinstance(out, ShardTensor) and torch.equal(out.local(), expected)
    assert torch.jit.ScriptFunction.__call__ is original


def test_a_scripted_module_called_on_rows_is_refused_by_name():
    meta = _meta(HALO)
    h = ShardTensor.wrap(torch.rand(meta.n_padded, 2, dtype=torch.float64), meta, ATOMS)
    block = torch.jit.script(_Block())
    with script_functions_dispatched(), pytest.raises(NoRuleError, match=r"TorchScript method `_Block.forward`"):
        block(h)
    assert torch.equal(block(h.local()), h.local() * 2)


def test_an_op_that_fails_on_this_ranks_rows_stops_with_the_op_and_the_fix():
    """NOTE [failed on this rank]: torch failing first (a rank with fewer rows than k, a view
    that does not fit this rank's rows) must not hide the refusal the other ranks raise."""
    h = ShardTensor.wrap(torch.rand(_meta(HALO).n_padded, 5, dtype=torch.float64), _meta(HALO), ATOMS)
    with pytest.raises(NoRuleError, match=r"`torch\.topk` on atom rows .*no exact cross-rank rule") as info:
        torch.topk(h[:, 0], 100)
    assert isinstance(info.value.__cause__, RuntimeError)  # torch's own error stays attached
    with pytest.raises(NoRuleError, match=r"`Tensor\.view` on atom rows .* failed on this rank \(RuntimeError: .*"
                                          r"holds 4 of the system's atoms"):
        h.view(4, 4)
