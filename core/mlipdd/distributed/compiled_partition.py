"""`CompiledPartitionCall`: ``DomainConfig(compile=True)`` under the graph-partition strategy.

Under graph partition the model already runs on plain tensors (the full gathered
geometry, its own graph) and crosses ranks only where it calls the partition helpers
(`gather_nodes`, `scatter_to_owners`, `sum_over_ranks`). Under ``torch.compile`` those
helpers switch to functional collectives (`mlipdd.shard.traced_collectives`), so the
exchanges are traced INTO the compiled forward and its force backward: nothing is
padded, nothing is deepened, and each rank still computes only its owned block.

# NOTE [no caps under graph partition]
Atoms never change owner here and every rank holds the full geometry, so the compiled
call's inputs keep their shapes for the whole run: there is nothing to pad. What varies
is the graph the model builds inside its forward (edges per call), which dynamo sees as
sizes inside the graph or as inputs of the graph after a break (a neighbour-list library
call); these dimensions go dynamic at their first change (dynamo's automatic dynamic
shapes, ``dynamic=None``), so an MD run compiles a second time, then no more.

The first call, and every call that compiled a new graph on any rank, is also run on
the eager graph-partition path and compared on every rank (NOTE [compiled equals eager]
in mlipdd.distributed.compiled), the decision agreed first: both paths issue collectives.
"""

from __future__ import annotations

import contextlib

from mlipdd.comm import agree_on_errors, any_rank
from mlipdd.distributed.compiled import CompileCounts, differs_from_eager
from mlipdd.shard.graph_partition import PartitionScope, partition_scope
from mlipdd.shard.traced_collectives import traced_partition

__all__ = ["CompiledPartitionCall"]


class CompiledPartitionCall(CompileCounts):
    """``call(batch, compute_stress, eager_call, installing) -> consolidated outputs``.

    ``batch``: this rank's owned block; the compiled call gets the full geometry of it, plain,
    with the partition's plain scope (NOTE [plain inside the compiled call]); ``model_call(batch,
    stress)``: the model's force call (compiled), run inside that scope and ``installing(rows)``
    (graph breaks run eagerly and read the partition from there); ``eager_call()``: the strategy's
    eager forward and consolidation (the checks). Counters: `CompileCounts` (no caps: NOTE
    [no caps under graph partition]).

    # NOTE [plain inside the compiled call]
    Traced, the helpers are functional collectives on plain tensors
    (`mlipdd.shard.traced_collectives`); a graph break runs them eagerly, and there they read the
    active scope: a plain one (no aten context), so both sides of a break hand plain tensors and
    the outputs are consolidated as plain partials (`consolidate_plain`: stress partials summed,
    full-row gradients reduce-scattered), never as the aten rows of the eager checks."""

    caps = None

    def __init__(self, model_call, strategy, spec, group, autograd_outputs, backend: str = "inductor"):
        super().__init__(backend, dynamic=None)
        self.model_call = model_call
        self.strategy = strategy
        self.spec = spec
        self.group = group
        self.autograd_outputs = autograd_outputs
        self.traced_collectives = 0  # functional collectives dynamo put in the graphs (none: nothing was traced)

    def _counting_backend(self, gm, example_inputs):
        self.traced_collectives += sum(_is_functional_collective(node.target) for node in gm.graph.nodes)
        return super()._counting_backend(gm, example_inputs)

    def __call__(self, batch, compute_stress: bool, eager_call, installing=lambda rows: contextlib.nullcontext()) -> dict:
        rows = self.last_rows = self.strategy.full_geometry(batch)
        scope = PartitionScope(self.strategy.state.partition)  # plain: NOTE [plain inside the compiled call]
        compute_stress = bool(compute_stress)
        with contextlib.ExitStack() as stack:
            stack.enter_context(installing(rows))  # the spec's adapters (the eager check installs its own)
            stack.enter_context(partition_scope(scope))
            holder = stack.enter_context(traced_partition(scope.partition))
            outputs, compiled_now = self._run_compiled(self.model_call, rows, compute_stress)
            scope.used = scope.used or holder.asked
        key = compute_stress
        first = key not in self._keys
        self._keys.add(key)
        result = self.strategy.consolidate_plain(outputs, scope, self.spec, self.autograd_outputs)
        if any_rank(first or compiled_now, self.group):  # every rank runs the eager path, or none
            self.checks += 1
            agree_on_errors(differs_from_eager(result, eager_call(), None), self.group)
        return result


def _is_functional_collective(target) -> bool:
    """A graph node that calls ``torch.distributed._functional_collectives`` (dynamo records
    the Python function or its ``_c10d_functional`` op)."""
    return "functional_collectives" in getattr(target, "__module__", "") or "c10d_functional" in str(target)
