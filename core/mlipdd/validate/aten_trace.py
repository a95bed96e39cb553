"""On a validation rank under the aten dispatch: which rules ran, and what escaped them.

`AtenRuleTrace` is a ``TorchDispatchMode`` entered around the model's own forward on each
spawned rank (`mlipdd.validate.rank_trace.watched_model`). It sits above the aten
`ShardTensor`, so it sees every aten op the model's forward (and its force backward)
issues, once, before the dispatch does, and none of the ops the rules run themselves.
For each op on distributed rows it counts the rule that takes it, looked up in the
dispatch's own order (NOTE [aten precedence] in `mlipdd.shard.aten.rules`): a rule's
name (``index_add``, ``sum_like``), ``row_local``, or a custom op the spec adapts; a
result that leaves the rows as a replicated value (a sum over the atoms, completed over
ranks) is counted as ``<rule> -> replicated`` (``x.new_zeros(n)``, replicated by
construction, is not). That is what the report's summary says
ran. An op without a rule is refused by the dispatch on every rank; the refusal, not
this trace, then explains the failure.

The dispatch cannot check what a model declares, so the trace keeps those as suspects,
named when the distributed answer differs: an op the user declared row-local
(`mlipdd.shard.aten.declare_row_local`), rows the model declared with
``mlipdd.shard.as_atom_rows`` (NOTE [declared rows]), and a factory sized by this rank's
row count whose values differ per row (``torch.arange(n)``, ``torch.randn(n)``): such a
tensor is taken for a replicated value, but its length is this rank's.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlipdd.shard.aten import ShardTensor
from mlipdd.shard.aten.placement import Replicate, Rows
from mlipdd.shard.aten.row_local import COPIES, ROW_LOCAL, USER_ROW_LOCAL
from mlipdd.shard.aten.rules import RULES, flat_args, op_name
from mlipdd.validate.coverage import record_view

aten = torch.ops.aten
# factories whose values differ from row to row: sized by a rank's row count, they are not
# the replicated value the dispatch takes them for
_PER_ROW_FACTORIES = {aten.arange, aten.linspace, aten.randn, aten.rand, aten.randperm, aten.randint}


# rules whose result is replicated by construction (a tensor of a given size), not a value
# completed over ranks
_MADE_REPLICATED = frozenset({"new_factory"})


def rule_of(func) -> str | None:
    """The name of what takes ``func`` on distributed rows, in the dispatch's order; None:
    refused (no rule, not row-local, not a custom op)."""
    fn = RULES.get(func) or RULES.get(func.overloadpacket)
    if fn is not None:
        return fn.__name__
    packet = func.overloadpacket
    if packet in ROW_LOCAL or packet in COPIES:
        return "row_local"
    if packet in USER_ROW_LOCAL:
        return f"declared row-local {op_name(packet)}"
    if getattr(func, "namespace", "aten") not in ("aten", "prims"):
        return f"custom op {op_name(packet)}"
    return None


class AtenRuleTrace(TorchDispatchMode):
    """``fired``: rule -> ops it took, this rank; ``suspects``: what the dispatch took on
    the model's word (module docstring); ``view``: what the model could read."""

    def __init__(self):
        super().__init__()
        self.fired: Counter = Counter()
        self.suspects: Counter = Counter()
        self.view: dict = {}
        self._counts: set[int] = set()

    def watch(self, batch) -> None:
        self.view = record_view(batch)
        owned = getattr(batch, "n_owned", None)
        counts = {self.view["rows"], self.view["edges"], int(owned) if owned is not None else -1}
        self._counts = {n for n in counts if n > 1}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shards = [a for a in flat_args(args, kwargs) if isinstance(a, ShardTensor)]
        if not shards:
            if func.overloadpacket in _PER_ROW_FACTORIES:
                self._sized_by_rows(func, args)
            return func(*args, **kwargs)
        rows = any(isinstance(s._place, Rows) for s in shards)
        if rows:
            self._declared(func, shards)
        out = func(*args, **kwargs)
        if rows:
            name = rule_of(func)
            if name is not None:
                if name not in _MADE_REPLICATED and isinstance(out, ShardTensor) and isinstance(out._place, Replicate):
                    name += " -> replicated"
                self.fired[name] += 1
        return out

    def _declared(self, func, shards) -> None:
        packet = func.overloadpacket
        if packet in USER_ROW_LOCAL and packet not in ROW_LOCAL and packet not in COPIES:
            self.suspects[f"{op_name(packet)} (declared row-local by the model)"] += 1
        if any(s._origin == "as_atom_rows" for s in shards):
            self.suspects[f"{op_name(packet)} (of rows declared by mlipdd.shard.as_atom_rows)"] += 1

    def _sized_by_rows(self, func, args) -> None:
        sizes = [a for a in flat_args(args, {}) if isinstance(a, int) and not isinstance(a, bool)]
        if sizes and self._counts and max(sizes) in self._counts:
            self.suspects[f"torch.{func.overloadpacket.__name__} over every row (sized by this rank's rows)"] += 1
