"""Registry of ``(op, predicate, handler)`` rules consulted by `ShardTensor` dispatch.

Handlers register with a decorator; the first rule whose predicate accepts the call
wins. Every firing is counted so a validation report can say which handlers a
distributed run actually exercised.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

Predicate = Callable[..., bool]
Handler = Callable[..., object]

_RULES: dict[object, list[tuple[Predicate, Handler, str]]] = {}
FIRED: Counter = Counter()


def _always(*args, **kwargs) -> bool:
    return True


def register(*ops, predicate: Predicate = _always, name: str | None = None, first: bool = False):
    """Decorator: ``handler(func, meta, args, kwargs)`` handles ``ops`` when ``predicate(meta, args, kwargs)``.

    ``first=True`` puts the rule ahead of the ones already registered: a storage layout
    whose predicates accept only its own metas (sharded storage) overrides the generic
    halo rules for those metas and leaves every other call to them.
    """

    def decorate(handler: Handler) -> Handler:
        label = name or handler.__name__
        for op in ops:
            rules = _RULES.setdefault(op, [])
            rules.insert(0 if first else len(rules), (predicate, handler, label))
        return handler

    return decorate


def lookup(func, meta, args, kwargs) -> tuple[Handler, str] | None:
    for predicate, handler, label in _RULES.get(func, ()):
        if predicate(meta, args, kwargs):
            return handler, label
    return None


def handled_ops() -> list:
    return list(_RULES)


def reset_counts() -> None:
    FIRED.clear()
