"""On a validation rank: which ops on atom or edge rows ran without a dispatch rule.

`RankOpTrace` is a ``TorchFunctionMode`` entered around the model's own forward on each
spawned rank (`watched_model`). A mode sees every torch call the model makes, before the
`ShardTensor` dispatch does, and none of the calls the dispatch rules make themselves.
For each call with a ShardTensor argument it notes whether a rule fired
(`mlipdd.shard.registry.FIRED` moved, size queries aside: other rules' predicates ask
those); a call on which none fired ran on this rank's rows alone. Most such calls are
row-local (``x * w``, ``tanh``); the trace keeps the ones that are not: the rows went in
and no rows came out (a flatten, a reshape, a reduction, a table indexed by element),
rows were reordered or accumulated along them (sort, cumsum, topk), or edge rows were
read by an index of another length (pairs of edges: triplets). What such a call returns
is marked, so a later reduction of it is named too (``x.flatten()`` then ``.max()``; a
mean of edges filtered by a mask). ``torch.arange(n)`` and ``bincount(...,
minlength=n)`` over every row, ghost rows included, are noted as well. When the
distributed answer differs, these are what the diagnosis names.

It also records the rank's view (`mlipdd.validate.coverage.record_view`) from the batch
the model is called with.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from mlipdd.validate.coverage import record_view
from mlipdd.validate.op_trace import op_name

# ops that mix values along a dim: suspects when that dim holds the rows. Per op: the
# position of its dim argument and its default (None: the whole tensor, flattened)
_ALONG_DIM = {
    "sort": (1, -1), "argsort": (1, -1), "msort": (None, 0), "topk": (2, -1), "kthvalue": (2, -1),
    "mode": (1, -1), "diff": (2, -1), "median": (1, None), "nanmedian": (1, None),
    "quantile": (2, None), "nanquantile": (2, None), "cumsum": (1, None), "cumprod": (1, None),
    "cummax": (1, None), "cummin": (1, None), "logcumsumexp": (1, None), "roll": (2, None),
    "unique": (None, None), "unique_consecutive": (None, None), "bincount": (None, None),
    "histc": (None, None), "segment_reduce": (None, None),
}
# ops that read rows by an index tensor: ordinary when the result has edge or atom rows
_INDEX_READS = frozenset({"__getitem__", "index_select", "gather", "take", "take_along_dim"})
# creation from a shape: no values read from the rows
_FACTORIES = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "zeros_like",
                        "ones_like", "empty_like", "full_like", "rand_like", "randn_like"})
# the base class's own autograd call, and what only describes a tensor
_IGNORED = frozenset({"grad", "backward", "size", "dim", "numel", "__len__", "__repr__", "__format__",
                      "requires_grad_", "detach", "item", "tolist", "__bool__", "is_floating_point",
                      "is_complex", "element_size", "stride", "storage_offset", "data_ptr", "__get__"})


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _short(name: str) -> str:
    return name.rpartition(".")[2] if name.startswith(("Tensor.", "torch.")) else name


def _along_rows(name: str, t: torch.Tensor, args, kwargs) -> bool:
    """Whether an `_ALONG_DIM` op works along dim 0 of ``t`` (or over all of it)."""
    position, default = _ALONG_DIM[name]
    dim = kwargs.get("dim", kwargs.get("dims", default))
    if "dim" not in kwargs and position is not None and len(args) > position:
        dim = args[position]
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if len(dim) == 1 else None
    if dim is None or not isinstance(dim, int) or t.dim() <= 1:
        return True
    return dim % t.dim() == 0


_FROM = "_mlipdd_validate_from"  # set on a tensor derived from rows in a way no rule knows


def _count_rules() -> frozenset[str]:
    """Rules that fire on size queries (``x.shape``): the predicates of other rules ask
    those too, so their firings say nothing about the call being traced."""
    from mlipdd.shard.registry import rules_in_order

    queries = (torch.Tensor.size, torch.Tensor.shape.__get__, torch.Tensor.dim, torch.Tensor.numel)
    return frozenset(r.name for r in rules_in_order() if any(op in queries for op in r.ops))


class RankOpTrace(TorchFunctionMode):
    """``suspects``: description -> calls that ran on rows without a rule and are not
    row-local (module docstring); ``view``: what the model could read (`record_view`)."""

    def __init__(self):
        super().__init__()
        self.node_rows = -1
        self.edge_rows = -1
        self.owned_rows = -1
        self.suspects: Counter = Counter()
        self.view: dict = {}
        self._ignored_rules = _count_rules()

    def watch(self, batch) -> None:
        view = record_view(batch)
        self.node_rows, self.edge_rows = view["rows"], view["edges"]
        owned = getattr(batch, "n_owned", None)  # halo and sharded set it, for diagnostics
        self.owned_rows = int(owned) if owned is not None else -1
        self.view = view

    def _rows(self, t: torch.Tensor) -> str | None:
        if t.dim() == 0:
            return None
        if t.shape[0] == self.node_rows:
            return "atom"
        if t.shape[0] == self.edge_rows:
            return "edge"
        return None

    def _fired(self) -> int:
        from mlipdd.shard.registry import FIRED

        return sum(n for name, n in FIRED.items() if name not in self._ignored_rules)

    def _sized_by_every_row(self, name, args, kwargs) -> None:
        """``torch.arange(n)`` / ``bincount(..., minlength=n)`` with n the rank's rows,
        ghost rows included: per-atom indices or counts over rows that are not all owned."""
        if not self.node_rows > self.owned_rows >= 0:
            return
        if name == "arange":
            sizes = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        elif name == "bincount":
            sizes = [kwargs.get("minlength", args[2] if len(args) > 2 else 0)]
        else:
            return
        if sizes and max(sizes) == self.node_rows:
            self.suspects[f"torch.{name} over every row (ghost rows too)"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from mlipdd.shard import ShardTensor

        name = _short(op_name(func))
        self._sized_by_every_row(name, args, kwargs)
        inputs = [t for t in _tensors((args, kwargs)) if isinstance(t, ShardTensor) or hasattr(t, _FROM)]
        if not inputs or name in _IGNORED:
            return func(*args, **kwargs)
        before = self._fired()
        out = func(*args, **kwargs)
        if self._fired() == before:
            self._classify(name, inputs, args, kwargs, out)
        return out

    def _classify(self, name, inputs, args, kwargs, out) -> None:
        outputs = list(_tensors(out))
        kinds = {self._rows(t) for t in inputs} - {None}
        if name in _FACTORIES or not outputs:
            return
        if kinds:
            rows = "atom" if "atom" in kinds else "edge"
            origin = f"{rows} rows"
            if name in _ALONG_DIM and _along_rows(name, inputs[0], args, kwargs):
                self.suspects[f"{name} (along the {rows} rows)"] += 1
                return
            if all(self._rows(t) is not None for t in outputs):
                return
            if name in _INDEX_READS:
                index = list(_tensors((args[1:], kwargs)))
                if any(t.dtype == torch.bool for t in index):
                    _mark(outputs, f"{rows} rows filtered by a mask")  # README rule 2 allows it
                elif not index:
                    self.suspects[f"{name} ({rows} rows picked by their position: other atoms on each rank)"] += 1
                elif rows == "edge":
                    self.suspects[f"{name} (edge rows read by an index of another length: pairs of edges)"] += 1
                    _mark(outputs, "pairs of edge rows")
                else:
                    _mark(outputs, f"{rows} rows read by an index of another length")
                return
        else:  # only inputs derived from rows by a call that no rule took
            derived = [t for t in inputs if hasattr(t, _FROM)]
            if not derived:
                return
            origin = getattr(derived[0], _FROM)
            length = derived[0].shape[0] if derived[0].dim() else None
            along = name in _ALONG_DIM  # where the rows went in a derived tensor is not known
            if not along and all(t.dim() and t.shape[0] == length for t in outputs):
                _mark(outputs, origin)  # still the same derived rows
                return
            if not along and name in _INDEX_READS and all(t.dim() for t in outputs):
                _mark(outputs, origin)
                return
            self.suspects[f"{name} (over {origin})"] += 1
            return
        if any(t.dim() == 0 for t in outputs):
            if all(not (t.is_floating_point() or t.is_complex()) for t in outputs):
                return  # a check or a size (``bool((z < 0).any())``): integer reductions stay local
            self.suspects[f"{name} (reduces over the {origin})"] += 1
            return
        self.suspects[f"{name} ({origin} in, other rows out)"] += 1
        _mark(outputs, f"{name} of {origin}")


def _mark(outputs, origin: str) -> None:
    for t in outputs:
        try:
            setattr(t, _FROM, origin)
        except (AttributeError, RuntimeError):  # a tensor type without a __dict__
            pass


def watched_model(model_factory, trace_slot: list, dispatch: str = "torch_function"):
    """``model_factory()`` as a wrapper whose forward runs under the trace of ``dispatch``
    (a `RankOpTrace`, or under the aten dispatch an `AtenRuleTrace`), appended to
    ``trace_slot`` (the worker reads it after the distributed forward)."""
    from mlipdd.testing.conformance import build_model

    model = build_model(model_factory)
    if dispatch == "aten":
        from mlipdd.validate.aten_trace import AtenRuleTrace

        trace = AtenRuleTrace()
    else:
        trace = RankOpTrace()
    trace_slot.append(trace)
    forward = model.forward

    def traced_forward(batch, *args, **kwargs):
        trace.watch(batch)
        with trace:
            return forward(batch, *args, **kwargs)

    model.forward = traced_forward
    return model


# what an op that ran on rows without a rule usually means in a model, by op
_IDIOMS = (
    (("reshape", "view", "flatten", "ravel", "t", "transpose", "permute", "movedim", "unflatten", "T", "mT"),
     ("a reduction over the atoms after a reshape or transpose runs over this rank's rows only "
     "(ghost rows included under halo storage)")),
    (("scatter_reduce", "scatter", "scatter_", "index_reduce", "index_put", "index_put_", "put", "put_"),
     "a table with one row per element (or per some other key) filled from this rank's rows only"),
    (("sort", "argsort", "msort", "topk", "kthvalue", "median", "nanmedian", "mode", "quantile",
      "nanquantile", "max", "min", "amax", "amin", "argmax", "argmin"),
     "an extreme or order statistic over the atoms sees only this rank's rows"),
    (("cumsum", "cumprod", "cummax", "cummin", "bincount", "unique", "unique_consecutive", "diff",
      "segment_reduce", "histc", "logcumsumexp"),
     ("counts or offsets (bincount, cumsum) of this rank's rows: segment sums and padded neighbour "
     "tables built from them miss what other ranks hold")),
    (("__getitem__", "index_select", "gather", "take", "take_along_dim"),
     ("pairs of edges (triplets) formed from this rank's edges only: the edges of a ghost atom live "
     "on the ranks that own its neighbours, so a triplet that shares a ghost sender is missed")),
    (("cat", "concat", "concatenate", "stack", "hstack", "vstack"),
     ("rows joined into a tensor of another length (extra edges or nodes) that the dispatch does "
     "not know")),
    (("torch.arange over every row (ghost rows too)",),
     ("indices over every row (self-loops from torch.arange(n_atoms)) include the ghost rows under "
     "halo storage")),
    (("torch.arange over every row (sized by this rank's rows)",
      "torch.linspace over every row (sized by this rank's rows)"),
     ("a tensor sized by this rank's row count (torch.arange(n_atoms), torch.arange(n_edges)) holds "
      "other values than in one process: self-loops, positions in a table, per-row numbers")),
    (tuple(f"torch.{name} over every row (sized by this rank's rows)" for name in ("randn", "rand", "randperm",
                                                                                   "randint")),
     "random numbers drawn for this rank's rows: one process draws other numbers for the same atoms"),
    (("torch.bincount over every row (ghost rows too)",),
     ("a count per atom by torch.bincount(index, minlength=n_atoms) counts this rank's edges only, "
     "and a ghost atom's edges to other ranks' atoms are not among them (count with "
     "torch.zeros(n).index_add(0, index, ones), which the scatter rules complete)")),
)


def idiom_of(suspect: str) -> str | None:
    """The idiom a suspect (``"op (why)"``) usually stands for, or None."""
    name, _, why = suspect.partition(" (")
    if why.startswith("declared row-local"):
        return (f"`{name}` declared row-local (mlipdd.shard.aten.declare_row_local) although its output rows "
                "depend on other rows")
    if "as_atom_rows" in why:
        return ("rows declared with mlipdd.shard.as_atom_rows whose values are not exact on each rank "
                "(computed on mlipdd.shard.local rows that miss other ranks' atoms or edges)")
    if suspect.startswith("torch."):
        name = suspect
    elif name in _INDEX_READS and "picked by their position" in why:
        return "a row picked by its place (x[0], x[:k]) is a different atom on each rank"
    elif name in _INDEX_READS and "pairs of edges" not in why:
        return None  # a read of something already derived: its origin is named already
    for names, idiom in _IDIOMS:
        if name in names:
            return idiom
    return None


def suspects_advice(wrong: str, suspects: dict[str, int], dispatch: str = "torch_function") -> tuple[str, str]:
    """``(diagnosis, next action)`` for a wrong answer after ops on rows without a rule
    (under the aten dispatch: after what it took on the model's word, `AtenRuleTrace`)."""
    ops = ", ".join(f"`{op}`" for op in suspects)
    idioms = list(dict.fromkeys(i for i in map(idiom_of, suspects) if i))
    if dispatch == "aten":
        diagnosis = (f"wrong {wrong}; the aten dispatch took these on the model's word (a declaration or a "
                     f"tensor sized by this rank's rows), and they are not exact per rank: {ops}")
    else:
        diagnosis = (f"wrong {wrong}; these ops ran on atom or edge rows without a dispatch rule, so each "
                     f"rank applied them to its own rows alone: {ops}")
    if idioms:
        diagnosis += ". Likely idiom: " + "; ".join(idioms)
    if dispatch == "aten":
        return diagnosis, (
            "check each of them: as_atom_rows only for values exact on each rank by construction (pairs of one "
            "receiver's edges, a receiver's own neighbour table), declare_row_local only for ops whose row i "
            "depends on row i alone, sizes from a sum over the rows (torch.ones_like(x).sum(0)) rather than "
            "x.shape; otherwise compute the step with ops that have a rule (index_select / index_add by the "
            "edge index, sums over the rows, row-local math), then re-validate")
    action = ("rewrite those steps with ops that have an exact rule (sum/mean/amax/amin/softmax/"
              "logsumexp/var/std over dim 0 of atom or edge rows, index_add/scatter_add into atom rows or "
              "per-system rows) or run the model under the graph_partition strategy")
    return diagnosis, action
