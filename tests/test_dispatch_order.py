"""The dispatch's order of precedence, pinned; typed layouts pick their rules; no import cycle.

NOTE [precedence] in mlipdd.shard.registry states the order once. These tests fail
when it changes, so a change of which rule wins is always a deliberate edit here.
"""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest
import torch
from mlipdd import shard
from mlipdd.cli import plugins_cmd
from mlipdd.shard import (
    ANY_OP,
    PRECEDENCE,
    ExchangePlan,
    GraphPartition,
    Halo,
    Layout,
    Replicated,
    Rows,
    Sharded,
    ShardMeta,
    ShardTensor,
    placement_of,
    registry,
    rules_in_order,
)

PINNED = [
    "op_adapter",
    "index_put_as_index_add",
    "scatter_mean_as_sums",
    "index_reduce_refused",
    "adjacency_as_scatter",
    "row_count",
    "sharded_gather",
    "sharded_scatter",
    "sharded_per_system_reduce",
    "sharded_global_sum",
    "zero_product",
    "rows_to_front",
    "row_mean",
    "row_extreme",
    "row_softmax",
    "row_logsumexp",
    "row_spread",
    "row_vector_norm",
    "row_reduction_refused",
    "row_contraction",
    "row_einsum",
    "all_pairs_refused",
    "replicated_expanded_to_rows",
    "replicated_to_rows",
    "halo_scatter",
    "per_system_reduce",
    "global_sum",
    "halo_read",
    "row_boundary",
]


def test_precedence_is_pinned():
    assert PRECEDENCE == PINNED
    assert [rule.name for rule in rules_in_order()] == PINNED


def test_cli_lists_the_rules_in_the_order_they_apply(capsys):
    assert plugins_cmd.run(plugins_cmd_args(handlers=True)) == 0
    text = capsys.readouterr().out
    positions = [text.index(f". {name} ") for name in PINNED]
    assert positions == sorted(positions), text
    assert "[Sharded]" in text and "[Halo]" in text and "ops: ANY_OP" in text


def plugins_cmd_args(**kwargs):
    import argparse

    return argparse.Namespace(**{"json": False, "strict": False, "handlers": False, **kwargs})


# ---- which rule a call reaches, by layout ------------------------------------------------
N_OWNED, N_GHOST, N_SYSTEMS, N_EDGES = 5, 3, 2, 11


def meta_for(layout: Layout) -> ShardMeta:
    one_rank = ExchangePlan(torch.zeros(N_GHOST, dtype=torch.long), (N_GHOST,), (N_GHOST,), N_OWNED)
    return ShardMeta(plan=one_rank, n_systems=N_SYSTEMS, n_edges=N_EDGES, layout=layout)


def rule_of(func, *args):
    meta = shard.tensor.find_meta(args, {})
    rule = registry.lookup(func, meta, args, {})
    return rule.name if rule is not None else None


def node_rows(meta):
    return ShardTensor.wrap(torch.zeros(meta.n_padded, 4, dtype=torch.float64), meta)


@pytest.mark.parametrize(
    ("layout", "node_scatter", "system_scatter", "row_sum", "read"),
    [
        (Halo(), "halo_scatter", "per_system_reduce", "global_sum", "halo_read"),
        (Halo(correct_scatters=False), None, "per_system_reduce", "global_sum", "halo_read"),
        (Sharded(), "sharded_scatter", "sharded_per_system_reduce", "sharded_global_sum", "sharded_gather"),
        (Sharded(route_gathers=False, route_scatters=False), None, "sharded_per_system_reduce",
         "sharded_global_sum", None),
        (GraphPartition(), None, None, None, None),
    ],
)
def test_each_layout_reaches_its_own_rules(layout, node_scatter, system_scatter, row_sum, read):
    meta = meta_for(layout)
    x = node_rows(meta)
    index = torch.zeros(N_EDGES, dtype=torch.long)
    edges = torch.ones(N_EDGES, 4, dtype=torch.float64)
    assert rule_of(torch.Tensor.index_add, x, 0, index, edges) == node_scatter
    per_system = torch.zeros(N_SYSTEMS, 4, dtype=torch.float64)
    assert rule_of(torch.Tensor.index_add, per_system, 0, index[: x.shape[0]], x) == system_scatter
    assert rule_of(torch.Tensor.sum, x) == row_sum
    assert rule_of(torch.Tensor.__getitem__, x, index) == read


def test_replicated_values_meet_rows_through_the_row_boundary_in_every_layout():
    for layout in (Halo(), Sharded()):
        meta = meta_for(layout)
        x = node_rows(meta)
        lam = ShardTensor.wrap(torch.ones(N_SYSTEMS, dtype=torch.float64), meta.as_replicated())
        assert lam.meta.layout == Replicated(source=layout)
        assert lam.meta.as_rows() == meta
        system_of_row = torch.zeros(x.shape[0], dtype=torch.long)
        assert rule_of(torch.Tensor.__getitem__, lam, system_of_row) == "replicated_to_rows"
        assert rule_of(torch.Tensor.__mul__, x[:, 0], lam[system_of_row]) is None  # already rows
        assert rule_of(torch.einsum, "n,n->n", lam[system_of_row], x[:, 0]) is None
        assert rule_of(torch.einsum, "s,s->s", lam, torch.ones(N_SYSTEMS, dtype=torch.float64)) is None
        assert rule_of(torch.outer, x[:, 0], lam) == "row_boundary"  # any op, last


@pytest.mark.parametrize("layout", [Halo(), Sharded()])
def test_a_stack_of_rows_keeps_its_rows_along_the_new_dim(layout):
    """NOTE [placements]: stacking as many row tensors as a rank has rows must not make the
    sum over the stack a sum over atoms (an all_reduce only that rank would issue): the
    stack's rows are along dim 1, whatever its dim 0 counts."""
    meta = meta_for(layout)
    stack = [node_rows(meta)[:, 0] + i for i in range(meta.n_padded)]  # dim 0 == the row count
    stacked = torch.stack(stack)
    assert stacked.shape[0] == meta.n_padded and placement_of(stacked) == Rows("atoms", dim=1)
    assert rule_of(torch.Tensor.sum, stacked, 0) is None  # along the stack: no collective
    for total in (torch.sum(stacked, dim=0), stacked.sum(0), stacked.mean(dim=0)):
        assert placement_of(total) == Rows("atoms")  # rows again (this test runs without a group)
    assert torch.equal(torch.sum(stacked, dim=0), sum(stack))
    assert placement_of(stacked[1]) == Rows("atoms") and placement_of(torch.unbind(stacked)[0]) == Rows("atoms")
    assert placement_of(torch.stack(stack, 1)) == Rows("atoms")  # along dim 1 the rows stay in front
    moved = stacked.transpose(0, 1)
    assert placement_of(moved) == Rows("atoms") and rule_of(torch.Tensor.sum, moved) in ("global_sum",
                                                                                       "sharded_global_sum")
    assert placement_of(stacked * 2) == Rows("atoms", dim=1)


def test_a_rule_states_its_place_or_is_refused():
    @contextlib.contextmanager
    def restored():
        rules, order = list(registry._RULES), list(PRECEDENCE)
        try:
            yield
        finally:
            registry._RULES[:] = rules
            PRECEDENCE[:] = order
            registry._CACHE.clear()

    with restored(), pytest.raises(ValueError, match="no place in mlipdd.shard.registry.PRECEDENCE"):
        registry.register(Halo, torch.Tensor.sum, name="my_sum")
    with restored():
        registry.register(Halo, torch.Tensor.sum, name="my_sum", before="global_sum")(lambda *a: None)
        order = [r.name for r in rules_in_order()]
        assert order.index("my_sum") == order.index("global_sum") - 1
        x = node_rows(meta_for(Halo()))
        assert rule_of(torch.Tensor.sum, x) == "my_sum"
    assert PRECEDENCE == PINNED
    with pytest.raises(TypeError, match="Layout type"):
        registry.register("halo", ANY_OP, name="op_adapter")


# ---- the import graph of shard/ ----------------------------------------------------------
SHARD = Path(shard.__file__).parent


def _shard_imports(path: Path) -> tuple[set[str], list[str]]:
    """(shard modules imported at module level, imports made inside functions)."""
    tree = ast.parse(path.read_text())
    top, nested = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.module == "mlipdd.shard":
                names = [f"mlipdd.shard.{a.name}" for a in node.names]
            shard_names = {n.split(".")[2] for n in names if n and n.startswith("mlipdd.shard.")}
            if node in tree.body:
                top |= shard_names
            elif shard_names:
                nested.append(ast.unparse(node))
    return top, nested


def test_shard_modules_import_without_a_cycle_and_nothing_on_the_hot_path():
    graph = {p.stem: _shard_imports(p)[0] & {q.stem for q in SHARD.glob("*.py")}
             for p in SHARD.glob("*.py") if p.stem != "__init__"}
    seen, done = set(), set()

    def visit(module, path):
        assert module not in seen or module in done, f"import cycle in mlipdd.shard: {' -> '.join(path)}"
        if module in done:
            return
        seen.add(module)
        for dep in graph.get(module, ()):
            visit(dep, [*path, dep])
        done.add(module)

    for module in graph:
        visit(module, [module])
    assert not _shard_imports(SHARD / "tensor.py")[1], "tensor.py imports inside a function"
    assert graph["tensor"] <= {"registry", "exchange", "layouts", "placement", "propagation", "gradients", "unseen",
                               "counts"}
