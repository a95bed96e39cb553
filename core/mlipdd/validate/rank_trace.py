"""On a validation rank: the trace around the model's forward, and what its suspects mean.

`watched_model` wraps a model so that its forward runs under the aten dispatch's trace
(`mlipdd.validate.aten_trace.AtenRuleTrace`: which rules ran, what was taken on the model's
word); `suspects_advice` turns the suspects of a wrong answer into a diagnosis, naming the
idiom each usually stands for (`idiom_of`).
"""

from __future__ import annotations


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


# NOTE [suspect idioms]: `AtenRuleTrace` names three kinds of suspects (what the dispatch
# takes on the model's word); each stands for one idiom
_SIZED_BY_ROWS = ("a tensor sized by this rank's row count (torch.arange(n_atoms), torch.arange(n_edges)) holds "
                  "other values than in one process: self-loops, positions in a table, per-row numbers")
_RANDOM = "random numbers drawn for this rank's rows: one process draws other numbers for the same atoms"


def idiom_of(suspect: str) -> str | None:
    """The idiom a suspect (``"op (why)"``) usually stands for, or None (NOTE [suspect idioms])."""
    name, _, why = suspect.partition(" (")
    if why.startswith("declared row-local"):
        return (f"`{name}` declared row-local (mlipdd.shard.aten.declare_row_local) although its output rows "
                "depend on other rows")
    if "as_atom_rows" in why:
        return ("rows declared with mlipdd.shard.as_atom_rows whose values are not exact on each rank "
                "(computed on mlipdd.shard.local rows that miss other ranks' atoms or edges)")
    if why.startswith("sized by this rank's rows"):
        return _RANDOM if name.startswith("torch.rand") else _SIZED_BY_ROWS
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
