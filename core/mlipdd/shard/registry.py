"""The dispatch rules of `ShardTensor`: one registry, keyed by (layout type, op).

A rule says: for tensors of this layout (a `mlipdd.shard.layouts.Layout` type;
``Layout`` itself means any layout), on these torch ops (or `ANY_OP`), when this
predicate ``(func, meta, args, kwargs) -> bool`` accepts the call, this handler
``(func, meta, args, kwargs)`` computes the result. Rules are registered
with `register` by the modules that implement them (`handlers`, `sharded_handlers`,
`replicated`, `custom_ops`).

# NOTE [precedence]
Which rule wins is stated here and only here: `PRECEDENCE` lists every rule by name
in the order the dispatch tries them, and `lookup` walks the rules of a call's
layout and op in that order. Import order and registration order play no part; a
rule whose name is not in `PRECEDENCE` is refused at registration unless it says
where it goes (``before=``). ``mlipdd plugins --handlers`` prints the order, and
``tests/test_dispatch_order.py`` pins it.

Every firing is counted in `FIRED`, so a validation report can say which rules a
distributed run exercised.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlipdd.shard.layouts import Layout

__all__ = ["ANY_OP", "FIRED", "PRECEDENCE", "Rule", "lookup", "register", "rules_in_order"]

Predicate = Callable[..., bool]
Handler = Callable[..., object]


class _AnyOp:
    def __repr__(self) -> str:
        return "ANY_OP"


ANY_OP = _AnyOp()  # a rule for every op (the rules that look at arguments, not at the op)

PRECEDENCE: list[str] = [
    # opaque custom ops (torch.library): only the spec's OpAdapter knows their rows
    "op_adapter",
    # other spellings of a sum into atom rows, rewritten into the ones below (dispatched again)
    "index_put_as_index_add",
    "scatter_mean_as_sums",
    "index_reduce_refused",
    "adjacency_as_scatter",
    # the size of a rows dimension: a count that is refused as a value (every layout;
    # `mlipdd.shard.counts`); under sharded storage factories make owned rows of it
    "row_count",
    # sharded storage: owned rows only. A node scatter is tried before a per-system one
    # (with as many atoms as systems, a scatter by a system index is per system).
    "sharded_gather",
    "sharded_scatter",
    "sharded_per_system_reduce",
    "sharded_global_sum",
    # a replicated value times the number 0 stays plain (every layout; NOTE [whole sums
    # are replicated] in `mlipdd.shard.handlers`)
    "zero_product",
    # a reduction over rows that are not along dim 0 (``x.t().mean(1)``, ``x.flatten().sum()``):
    # the rows moved to the front, then the rules below
    "rows_to_front",
    # means, extremes and products over atom/edge rows, and the reductions over rows with
    # no exact cross-rank form, refused (halo and sharded: `mlipdd.shard.row_reductions`)
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
    # a replicated value expanded to one copy per atom or edge row (``u.expand(n_atoms, -1)``)
    "replicated_expanded_to_rows",
    # a replicated value meeting per-rank rows in arithmetic or indexing (every layout;
    # after the sharded rules, whose predicates never accept a replicated operand first)
    "replicated_to_rows",
    # halo storage: [owned | ghost] rows
    "halo_scatter",
    "per_system_reduce",
    "global_sum",
    "halo_read",
    # last: a replicated value meeting rows in any other op (einsum, matmul, ...)
    "row_boundary",
]


@dataclass(frozen=True)
class Rule:
    name: str
    layout: type  # a Layout subclass; Layout itself: every layout
    ops: tuple
    predicate: Predicate
    handler: Handler
    doc: str = ""

    def describe(self) -> str:
        """One line on what the rule does (its ``doc``, else the handler's first doc line)."""
        first = (self.doc or self.handler.__doc__ or "").strip().splitlines()
        return first[0] if first else ""

    def op_names(self) -> list[str]:
        return [_op_name(op) for op in self.ops]


_RULES: list[Rule] = []
_CACHE: dict[tuple[type, object], tuple[Rule, ...]] = {}
FIRED: Counter = Counter()


def _always(*args, **kwargs) -> bool:
    return True


def register(layout: type, *ops, name: str, predicate: Predicate = _always, before: str | None = None,
             doc: str = ""):
    """Decorator: ``handler(func, meta, args, kwargs)`` handles ``ops`` (or `ANY_OP`) on
    tensors of ``layout`` when ``predicate(func, meta, args, kwargs)`` accepts the call.

    ``name`` must be listed in `PRECEDENCE`; a new rule (a plugin's layout) names the
    existing rule it goes ahead of with ``before=``. ``doc``: one line for listings
    (default: the handler's docstring).
    """
    if not (isinstance(layout, type) and issubclass(layout, Layout)):
        raise TypeError(f"register's first argument is a Layout type (Halo, Sharded, ...), got {layout!r}")
    if not ops:
        raise TypeError(f"rule {name!r} names no op; pass the torch ops it handles, or ANY_OP")
    if name not in PRECEDENCE:
        if before is None or before not in PRECEDENCE:
            raise ValueError(
                f"rule {name!r} has no place in mlipdd.shard.registry.PRECEDENCE; register it with "
                f"before=<the rule it goes ahead of> (one of {PRECEDENCE})"
            )
        PRECEDENCE.insert(PRECEDENCE.index(before), name)

    def decorate(handler: Handler) -> Handler:
        _RULES.append(Rule(name, layout, tuple(ops), predicate, handler, doc))
        _CACHE.clear()
        return handler

    return decorate


def _candidates(layout_type: type, func) -> tuple[Rule, ...]:
    """The rules for ``(layout_type, func)``, in precedence order (cached)."""
    key = (layout_type, func)
    rules = _CACHE.get(key)
    if rules is None:
        matching = [
            r for r in _RULES
            if issubclass(layout_type, r.layout) and (func in r.ops or ANY_OP in r.ops)
        ]
        rules = tuple(sorted(matching, key=lambda r: PRECEDENCE.index(r.name)))
        _CACHE[key] = rules
    return rules


def lookup(func, meta, args, kwargs) -> Rule | None:
    """The first rule, in `PRECEDENCE` order, that accepts this call; None: run the op as is."""
    for rule in _candidates(type(meta.layout), func):
        if rule.predicate(func, meta, args, kwargs):
            return rule
    return None


def rules_in_order() -> list[Rule]:
    """Every registered rule, in the order the dispatch tries them."""
    return sorted(_RULES, key=lambda r: PRECEDENCE.index(r.name))


def reset_counts() -> None:
    FIRED.clear()


def _op_name(op) -> str:
    if op is ANY_OP:
        return "ANY_OP"
    name = getattr(op, "__name__", None)
    if name is None:
        return repr(op)
    if name == "__get__":  # a property, e.g. Tensor.shape
        return f"Tensor.{getattr(getattr(op, '__self__', None), '__name__', name)}"
    if getattr(torch.Tensor, name, None) is op:
        return f"Tensor.{name}"
    if getattr(torch, name, None) is op:
        return f"torch.{name}"
    return str(op) if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) else name
