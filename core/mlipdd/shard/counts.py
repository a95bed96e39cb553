"""Row counts: sizes of this rank's rows, usable as sizes, refused as values.

# NOTE [counts are sizes]
``h.shape[0]`` of atom rows is this rank's count (``[owned | ghost]`` rows under halo
storage, owned rows under sharded storage), ``edge_index.shape[1]`` this rank's edges.
As a SIZE (``torch.zeros(n, F)``, ``x.view(n, -1)``, ``range(n)``) it is what the model
means. As a VALUE it differs from one process's count: an average degree
``n_edges / n_atoms`` computed from tensor sizes, a mean written ``h.sum(0) / h.shape[0]``,
an energy per atom. Python arithmetic on ints never reaches the dispatch, so the count
itself carries the fact: the size of a rows dimension is a `LocalCount` (an ``int``), and
arithmetic on it gives a `LocalCount` or a `LocalRatio` (a ``float``) again. When one
meets rows or a replicated value in an op that makes floating-point numbers
(``messages / average``), the op is refused, naming where the count came from and the
exact alternatives. Integer arithmetic with it (``receiver * n + sender``: rank-local
index structures) and every use as a size stay allowed.

``float(n)`` and the math functions that take a float (``math.sqrt(n)``) are refused
outright: a count made a float is a value. A count that leaves as an integer (``int(n)``,
``len(x)``, ``torch.tensor(n)``, ``math.log(n)``, which reads an int's digits), or meets a
float on its LEFT (``1.0 / n``, ``0.5 * n``: float's own operator answers without asking
the int), is a plain number again; validation catches those.

Under sharded storage the leading size of owned atom rows is a `RowCount`, a
`LocalCount` that factories turn into owned rows (NOTE [row counts] in
`mlipdd.shard.owned_rows`); arithmetic on it gives a plain `LocalCount`.
"""

from __future__ import annotations

import torch

from mlipdd.shard.layouts import Layout
from mlipdd.shard.placement import describe, placement_of
from mlipdd.shard.registry import _op_name as op_name
from mlipdd.shard.registry import register

__all__ = ["LocalCount", "LocalRatio", "RowCount", "counted_rows", "refuse_count_values"]


class LocalCount(int):
    """The size of a rows dimension on this rank (NOTE [counts are sizes])."""

    origin = None  # (size query, placement, shape): where the count was read
    derived = False  # computed from counts (``n * 3``): no longer the size of those rows

    def __new__(cls, value: int, origin=None, **_):
        count = super().__new__(cls, value)
        count.origin = origin
        return count

    def __reduce__(self):
        return int, (int(self),)  # pickled (sent, saved) as the plain number


class LocalRatio(float):
    """A float computed from a `LocalCount` (``n_edges / n_atoms``)."""

    origin = None

    def __new__(cls, value: float, origin=None):
        ratio = super().__new__(cls, value)
        ratio.origin = origin
        return ratio

    def __reduce__(self):
        return float, (float.__float__(self),)


class RowCount(LocalCount):
    """This rank's number of owned atom rows under sharded storage, remembering their
    layout: factories given it make owned rows (NOTE [row counts] in owned_rows)."""

    meta = None

    def __new__(cls, value: int, meta=None, origin=None):
        count = super().__new__(cls, value, origin)
        count.meta = meta
        return count


def _tainted(result, origin):
    if type(result) is int:
        count = LocalCount(result, origin)
        count.derived = True
        return count
    if type(result) is float:
        return LocalRatio(result, origin)
    return result


def _keeps_origin(name: str, base: type, unary: bool = False):
    plain = getattr(base, name)

    if unary:
        def method(self):
            return _tainted(plain(self), self.origin)
    else:
        def method(self, other):
            try:
                result = plain(self, other)
            except ZeroDivisionError:  # 0 rows on this rank: the other ranks refuse the value later
                count = other if type(other) in _COUNT_TYPES else self
                raise count_refusal(f"Python's `{name}` (division by zero)", count) from None
            if result is NotImplemented and base is int and isinstance(other, float):
                result = getattr(float, name)(int.__float__(self), other)  # n * 0.5: float's rule, kept tainted
            if result is NotImplemented:
                return result
            return _tainted(result, self.origin or getattr(other, "origin", None))
    method.__name__ = name
    return method


_BINARY = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
           "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__")
_UNARY = ("__neg__", "__pos__", "__abs__")
for _base, _cls in ((int, LocalCount), (float, LocalRatio)):
    for _name in _BINARY:
        setattr(_cls, _name, _keeps_origin(_name, _base))
    for _name in _UNARY:
        setattr(_cls, _name, _keeps_origin(_name, _base, unary=True))


def _refused_float(self):
    """``float(n)``, ``math.sqrt(n)``, ``math.exp(n)``: a count leaving for a float is a value."""
    raise count_refusal("`float()` (or a math function)", self)


LocalCount.__float__ = LocalRatio.__float__ = _refused_float


# ---- where counts come from: the size of a rows dimension ------------------------------
_SHAPE = torch.Tensor.shape.__get__
_SIZE_QUERIES = (_SHAPE, torch.Tensor.size)


def _counts_rows(func, meta, args, kwargs) -> bool:
    x = args[0] if args else None
    layout = getattr(x, "_meta", None) and x._meta.layout
    return bool(layout) and (layout.is_checked() or layout.is_sharded()) and x.dim() > 0


@register(Layout, *_SIZE_QUERIES, name="row_count", predicate=_counts_rows)
def row_count(func, meta, args, kwargs):
    """The size of the rows dimension as a LocalCount (a RowCount for sharded owned atoms)."""
    x = args[0]
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
        ndim = x.dim()
        place = placement_of(x)  # a first guess reads x.shape: not through this rule again
        if place is None or place.dim is None:
            return out
        origin = (func, place, tuple(x.shape))  # worded only when refused (`_origin_text`)
    rows_dim = place.dim

    layout = x._meta.layout

    def count(n: int, dim: int):
        if dim != rows_dim:
            return n
        if dim == 0 and place.kind == "atoms" and place.group == 1 and layout.is_sharded():
            return RowCount(n, x._meta, origin)
        return LocalCount(n, origin) if layout.is_checked() else n

    if isinstance(out, torch.Size):
        return torch.Size(count(n, d) for d, n in enumerate(out))
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return count(out, dim + ndim if dim < 0 else dim)


def counted_rows(size):
    """The placement of the rows ``size`` counts (the size of a rows dim read as it is), or None."""
    if isinstance(size, LocalCount) and not size.derived and size.origin is not None:
        return size.origin[1]
    return None


# ---- where counts are refused: as values next to rows -----------------------------------
def _origin_text(origin) -> str:
    if origin is None:
        return "a size of rows"
    func, place, shape = origin
    return f"`{op_name(func)}` of {describe(place)}, shaped {shape} on this rank"


_COUNT_TYPES = (LocalCount, LocalRatio, RowCount)


def refuse_count_values(func, args, kwargs, out) -> None:
    """Raise when ``func`` made floating-point numbers from a `LocalCount` or `LocalRatio`
    argument (NOTE [counts are sizes]); called for ops on rows or replicated values."""
    for a in args:
        if type(a) in _COUNT_TYPES:
            break
    else:
        if not kwargs or not any(type(v) in _COUNT_TYPES for v in kwargs.values()):
            return
        a = next(v for v in kwargs.values() if type(v) in _COUNT_TYPES)
    if not isinstance(out, torch.Tensor) or not (out.is_floating_point() or out.is_complex()):
        return
    raise count_refusal(f"`{op_name(func)}`", a)


def count_refusal(what: str, count):
    """The refusal of ``count`` (a `LocalCount` or `LocalRatio`) used as a value by ``what``."""
    from mlipdd.shard.propagation import NoRuleError  # propagation imports this module

    return NoRuleError(
        f"{what} uses the number {count!r} computed from this rank's row count ({_origin_text(count.origin)}) as a "
        "value: under domain decomposition a rank counts only its own rows (with ghost copies under "
        "halo storage), one process counts the whole system, so the result would differ "
        "(NOTE [counts are sizes] in mlipdd.shard.counts). Count exactly over ranks instead: "
        "torch.ones_like(x[:, 0]).sum() for the atoms or edges of x, an index_add of ones by "
        "batch.batch per system, x.mean(0) for a mean over the rows; or use a constant from the "
        "model's config (MACE's avg_num_neighbors)."
    )

