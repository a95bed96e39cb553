"""On a validation rank: the trace around the model's forward, and what its suspects mean.

`watched_model` wraps a model so that its forward runs under the aten dispatch's trace
(`mlipdd.validate.aten_trace.AtenRuleTrace`: which rules ran, what was taken on the model's
word); `suspects_advice` turns the suspects of a wrong answer into a diagnosis, naming the
idiom each usually stands for (`idiom_of`).
"""

from __future__ import annotations

# ops that read rows by an index tensor: ordinary when the result has edge or atom rows
_INDEX_READS = frozenset({"__getitem__", "index_select", "gather", "take", "take_along_dim"})


def watched_model(model_factory, trace_slot: list):
    """``model_factory()`` as a wrapper whose forward runs under an `AtenRuleTrace`, appended
    to ``trace_slot`` (the worker reads it after the distributed forward)."""
    from mlipdd.testing.conformance import build_model
    from mlipdd.validate.aten_trace import AtenRuleTrace

    model = build_model(model_factory)
    trace = AtenRuleTrace()
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


def suspects_advice(wrong: str, suspects: dict[str, int]) -> tuple[str, str]:
    """``(diagnosis, next action)`` for a wrong answer after what the aten dispatch took on the
    model's word (`AtenRuleTrace`)."""
    ops = ", ".join(f"`{op}`" for op in suspects)
    idioms = list(dict.fromkeys(i for i in map(idiom_of, suspects) if i))
    diagnosis = (f"wrong {wrong}; the aten dispatch took these on the model's word (a declaration or a "
                 f"tensor sized by this rank's rows), and they are not exact per rank: {ops}")
    if idioms:
        diagnosis += ". Likely idiom: " + "; ".join(idioms)
    return diagnosis, (
        "check each of them: as_atom_rows only for values exact on each rank by construction (pairs of one "
        "receiver's edges, a receiver's own neighbour table), declare_row_local only for ops whose row i "
        "depends on row i alone, sizes from a sum over the rows (torch.ones_like(x).sum(0)) rather than "
        "x.shape; otherwise compute the step with ops that have a rule (index_select / index_add by the "
        "edge index, sums over the rows, row-local math), then re-validate")
