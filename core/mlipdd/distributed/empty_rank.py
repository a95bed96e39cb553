"""A model's own code failing on a rank that owns no atom, explained.

# NOTE [a rank owning no atom]
A slab split along its vacuum, a small molecule on many ranks or sharded storage of a few
atoms leave a rank with no atom of its own. mlipdd's rules run on such a rank as on any
other, but Python arithmetic on sizes (``n_edges / n_atoms``) or an index into empty rows
(``x[-1]``) in the model's code fails there with Python's or torch's bare error
(ZeroDivisionError, IndexError, ...), which names neither the cause nor a fix. On a rank
with no atoms such an error is re-raised as `EmptyRankError`, which says both (the
original stays chained); errors mlipdd raised itself pass unchanged.
"""

from __future__ import annotations

import contextlib

_BARE = (ArithmeticError, IndexError, ValueError, TypeError, RuntimeError)


class EmptyRankError(RuntimeError):
    """The model's code failed on a rank that owns no atom."""


def _ours(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] == "mlipdd"


@contextlib.contextmanager
def explained_on_an_empty_rank(n_owned: int, rank: int, world_size: int):
    try:
        yield
    except _BARE as exc:
        if n_owned or _ours(exc):
            raise
        raise EmptyRankError(
            f"rank {rank} of {world_size} owns no atom of this batch, and the model's code failed on its "
            f"empty inputs: {type(exc).__name__}: {exc}. mlipdd cannot see that step (Python arithmetic on "
            "sizes, an index into empty rows). Fix: run this system on fewer ranks (at least one atom each), "
            "choose a split that gives every rank atoms (DomainConfig(grid=...) along the filled axes, not "
            "across vacuum), or make the model handle a batch of zero atoms") from exc
