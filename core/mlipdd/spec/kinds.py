"""What shape a named model output has, which decides how it is consolidated."""

from __future__ import annotations

import enum


class OutputKind(enum.Enum):
    """Shape class of one named output.

    * ``PER_NODE``: one row per atom (forces, atomic energies). Ghost rows are dropped
      and, unless the output is owned-only, ghost partials go back to their owners.
    * ``PER_GRAPH``: one row per system (energy, stress); replicated on every rank,
      kept as it is (summed first when named in ``all_reduce_outputs``).
    * ``GLOBAL``: one value for the whole batch; replicated on every rank, kept as it is.
    * ``UNKNOWN``: not declared; a tensor with one row per atom of this rank is treated
      as PER_NODE, anything else is passed through untouched.

    `mlipdd.strategy.outputs.consolidate_outputs` applies these rules for every strategy.
    """

    PER_NODE = "per_node"
    PER_GRAPH = "per_graph"
    GLOBAL = "global"
    UNKNOWN = "unknown"

    def is_per_graph(self) -> bool:
        return self is OutputKind.PER_GRAPH

    def is_global(self) -> bool:
        return self is OutputKind.GLOBAL

    @classmethod
    def parse(cls, value: OutputKind | str, *, output: str = "") -> OutputKind:
        """``value`` as an ``OutputKind``; accepts the member itself, its name or value."""
        from mlipdd.spec.errors import SpecError

        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for kind in cls:
                if value in (kind.name, kind.value):
                    return kind
        where = f" for output {output!r}" if output else ""
        known = ", ".join(kind.name for kind in cls)
        raise SpecError(f"unknown output kind {value!r}{where}; use one of OutputKind.{{{known}}}")
