"""Transforms: what to do with one argument or one output at an opaque op's boundary.

An ``OpAdapter`` maps argument / output positions to these markers, each for one
``side`` (an ``OpAdapter`` refuses one used on the wrong side); `mlipdd.shard.custom_ops`
interprets them around the op call, which only ever sees plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["TRANSFORM_TYPES", "AllReduceSum", "GatherInputs", "GatherInputsFull", "ScatterOutputs",
           "SliceOutputsOwned", "SliceOwned", "Transform"]


@dataclass(frozen=True)
class _TransformBase:
    side: ClassVar[str] = ""  # "input" or "output"


@dataclass(frozen=True)
class GatherInputs(_TransformBase):
    """Input transform: halo-pad an owned-rows argument to ``[owned | ghost]`` rows, so
    the op sees the ghost rows it reads (halo storage)."""

    side: ClassVar[str] = "input"


@dataclass(frozen=True)
class GatherInputsFull(_TransformBase):
    """Input transform: all-gather an owned-rows argument to every global row, for ops
    that need the whole system (the sharded-storage counterpart of GatherInputs)."""

    side: ClassVar[str] = "input"


@dataclass(frozen=True)
class SliceOwned(_TransformBase):
    """Input transform: drop ghost rows, handing the op only this rank's owned rows."""

    side: ClassVar[str] = "input"


@dataclass(frozen=True)
class ScatterOutputs(_TransformBase):
    """Output transform: a per-atom output with partials in ghost rows; send the ghost
    partials back to their owners, add them, then refresh the ghost rows."""

    side: ClassVar[str] = "output"


@dataclass(frozen=True)
class AllReduceSum(_TransformBase):
    """Output transform: the output is a per-rank partial sum; add it across ranks (the
    backward pass is the same sum, so autograd stays consistent)."""

    side: ClassVar[str] = "output"


@dataclass(frozen=True)
class SliceOutputsOwned(_TransformBase):
    """Output transform: the op returned every global row; keep only this rank's owned
    rows (pairs with GatherInputsFull)."""

    side: ClassVar[str] = "output"


Transform = (
    GatherInputs | GatherInputsFull | SliceOwned | ScatterOutputs | AllReduceSum | SliceOutputsOwned
)

TRANSFORM_TYPES: dict[str, type[_TransformBase]] = {
    cls.__name__: cls
    for cls in (GatherInputs, GatherInputsFull, SliceOwned, ScatterOutputs, AllReduceSum, SliceOutputsOwned)
}


def is_transform(obj: object) -> bool:
    return isinstance(obj, _TransformBase)
