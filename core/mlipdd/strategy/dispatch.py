"""Which ShardTensor dispatch a run uses: asked for, declared by the model, or the strategy's.

# NOTE [choosing the dispatch]
Two dispatches exist while the Python-level one (``__torch_function__``, `mlipdd.shard`) is
retired (issue 21): the aten-level one (`mlipdd.shard.aten`), the default, has one rule per
aten op and refuses, on every rank, an op on atom rows it has no exact rule for. A run uses
the first of: ``DomainConfig.dispatch``; ``MLIPDD_DISPATCH``; the dispatch the model declares it
needs (a wrapper's ``needs_dispatch``: UMA's halo spec; a pipeline's when a member declares
one); the first of the strategy's ``dispatches`` (halo, sharded, graph partition: aten,
then ``"torch_function"``). ``compile=True`` changes nothing here: at several ranks the
compiled region reads plain rows (`mlipdd.distributed.compiled_halo.HaloRows`) or traces
its collectives (`compiled_partition`), and its eager checks run the chosen dispatch. ``DomainConfig(dispatch="torch_function")`` or
``MLIPDD_DISPATCH=torch_function`` picks the old one. A launcher hands its ``MLIPDD_DISPATCH``
to the ranks it starts (`dispatch_env` / `adopt_dispatch_env`: a forkserver's child would
otherwise see the server's environment). What a model or strategy needs is declared by name,
never guessed from a failure: an aten refusal stays a refusal, nothing falls back to the other
dispatch. Tests that still need the old one say so with ``@pytest.mark.old_dispatch(reason)``
(`mlipdd.testing.pytest_plugin`; docs/aten_default_flip.md lists them).
"""

from __future__ import annotations

import os

from mlipdd.data import InputError

ATEN = "aten"
TORCH_FUNCTION = "torch_function"
DISPATCHES = (ATEN, TORCH_FUNCTION)


def dispatch_env() -> str | None:
    """This process's ``MLIPDD_DISPATCH``, for a launcher to hand to the ranks it starts (set but
    empty reads as unset, as a shell's ``MLIPDD_DISPATCH= cmd`` means)."""
    return os.environ.get("MLIPDD_DISPATCH") or None


def adopt_dispatch_env(value: str | None) -> None:
    """In a started rank: take the launcher's ``MLIPDD_DISPATCH`` (`dispatch_env`). A rank forked
    from a forkserver has the server's environment, fixed when the server started, not the one
    its launcher has now (a variable set later, by a test or a script, would not reach it)."""
    if value is None:
        os.environ.pop("MLIPDD_DISPATCH", None)
    else:
        os.environ["MLIPDD_DISPATCH"] = value


def dispatch_for(config, strategy_cls: type, model=None, world_size: int | None = None) -> str:
    """The dispatch a run of ``model`` under ``strategy_cls`` uses (NOTE [choosing the dispatch];
    ``world_size`` None: not known yet, taken as several ranks)."""
    name = getattr(config, "dispatch", None) or dispatch_env()
    if name is None:
        name = getattr(model, "needs_dispatch", None)
    if name is None:
        name = strategy_cls.dispatches[0] if strategy_cls.dispatches else TORCH_FUNCTION
    if name not in DISPATCHES:
        raise InputError(f"dispatch {name!r} (DomainConfig.dispatch / MLIPDD_DISPATCH / a wrapper's needs_dispatch) "
                         f"is not one of {DISPATCHES}")
    return name


def strategy_for_dispatch(strategy_cls: type, config, model=None, world_size: int | None = None) -> type:
    """The strategy class to run: ``strategy_cls`` in the form of `dispatch_for`'s dispatch."""
    name = dispatch_for(config, strategy_cls, model, world_size)
    if not strategy_cls.dispatches:  # a strategy that builds its own rows: the setting does not apply
        return strategy_cls
    if name not in strategy_cls.dispatches:
        raise InputError(
            f"the {getattr(strategy_cls, 'name', strategy_cls)!r} strategy runs the {' / '.join(strategy_cls.dispatches)} "
            f"dispatch, not {name!r} (DomainConfig.dispatch / MLIPDD_DISPATCH): use strategy='halo', 'sharded' "
            "or 'graph_partition' for the aten dispatch, or leave the dispatch unset"
        )
    return strategy_cls.with_dispatch(name)


def aten_form(cls: type, aten_cls: type) -> type:
    """``aten_cls`` (the aten form of a built-in strategy) for ``cls``, or for a subclass of
    the built-in one (a third party's planner, say) a class of both, made once."""
    if issubclass(cls, aten_cls):
        return cls
    if aten_cls.__bases__ == (cls,):
        return aten_cls
    made = _MADE.get((cls, aten_cls))
    if made is None:
        made = _MADE[(cls, aten_cls)] = type(f"{cls.__name__}Aten", (aten_cls, cls), {"__module__": cls.__module__})
    return made


_MADE: dict[tuple[type, type], type] = {}
