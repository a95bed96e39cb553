"""Storage policies: where a rank keeps its per-atom rows.

A policy is a frozen dataclass whose ``kind`` names the row layout a strategy serves
(``accepts``). What crosses ranks is decided per tensor by its placement in the aten
dispatch, not by the policy: the ``scatter`` / ``gather`` / ``system_reductions`` fields
the policies once carried were read by the deleted torch-function dispatch only, and
spec files that still hold them load with them ignored (`mlipdd.spec.serialize`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

from mlipdd.spec.errors import SpecError

__all__ = [
    "POLICY_KINDS",
    "GraphPartitionPolicy",
    "HaloStoragePolicy",
    "LocalPolicy",
    "ShardedStoragePolicy",
    "StoragePolicy",
    "merge_policies",
]


@dataclass(frozen=True)
class _PolicyBase:
    """Shared predicates; use one of the concrete policies."""

    kind: ClassVar[str] = ""

    def is_halo(self) -> bool:
        return self.kind == "halo"

    def is_sharded(self) -> bool:
        return self.kind == "sharded"

    def is_local(self) -> bool:
        return self.kind == "local"

    def is_graph_partition(self) -> bool:
        return self.kind == "graph_partition"

    def merge_with(self, other) -> _PolicyBase | None:
        """The policy of a pipeline running a block under ``self`` and one under ``other``,
        for a pair the merge table does not list (a policy a third party defines answers
        here; None: no answer, and the other operand is asked)."""
        return None

    def rules(self) -> dict[str, object]:
        """The policy's fields as a plain dict (what a spec file stores)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class HaloStoragePolicy(_PolicyBase):
    """Rows are ``[owned | ghost]``; ghost rows mirror remote owners (MACE, LJ, Ewald)."""

    kind: ClassVar[str] = "halo"

    # NOTE [own graph]: a model that builds its own open-boundary graph over the padded
    # rows (UMA) ignores the periodic local list, so it needs every periodic image within
    # the halo as a ghost row, also along the axes the rank grid does not cut.
    builds_own_graph: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.builds_own_graph, bool):
            raise SpecError(f"HaloStoragePolicy.builds_own_graph must be True or False, not {self.builds_own_graph!r}")


@dataclass(frozen=True)
class ShardedStoragePolicy(_PolicyBase):
    """Each rank stores only its owned rows; cross-rank reads and scatters go over the
    wire (models with a per-system reduction in every layer, such as AIMNet2)."""

    kind: ClassVar[str] = "sharded"


@dataclass(frozen=True)
class LocalPolicy(_PolicyBase):
    """Everything stays on the rank: no exchange, no reduction (single-process models,
    or blocks whose inputs are already complete on every rank)."""

    kind: ClassVar[str] = "local"


@dataclass(frozen=True)
class GraphPartitionPolicy(_PolicyBase):
    """Every rank holds all positions and owns a block of nodes (graph partition, UMA).

    Node features are all-gathered per layer by the model's adapters, so the ops
    themselves stay local; per-system sums are reduced across ranks.
    """

    kind: ClassVar[str] = "graph_partition"


StoragePolicy = HaloStoragePolicy | ShardedStoragePolicy | LocalPolicy | GraphPartitionPolicy

POLICY_KINDS: dict[str, type[_PolicyBase]] = {
    cls.kind: cls
    for cls in (HaloStoragePolicy, ShardedStoragePolicy, LocalPolicy, GraphPartitionPolicy)
}


# NOTE [policy composition]: when two sub-models share one pipeline, their policies are
# merged by this table, keyed by the unordered pair of kinds. A value is the kind of the
# merged policy (the operand of that kind is kept) or, for an _Incompatible entry, the
# reason the pair cannot share a pipeline. "local" joins anything because it asks for
# nothing; "sharded" wins over "halo" because a sharded layout can serve a halo block's
# reads over the wire but not the other way round.
@dataclass(frozen=True)
class _Incompatible:
    reason: str


_GP_VS_SPATIAL = _Incompatible(
    "graph-partition storage replicates every position on every rank and partitions nodes "
    "logically, while {other} storage partitions atoms in space; one pipeline has one row "
    "layout, so the two cannot share it. Run the blocks as separate distributed models, "
    "or give the graph-partition block a {other} spec (most MPNNs also run under "
    "SPEC_MPNN_HALO)"
)

_MERGE_TABLE: dict[frozenset[str], str | _Incompatible] = {
    frozenset({"halo"}): "halo",
    frozenset({"halo", "sharded"}): "sharded",
    frozenset({"sharded"}): "sharded",
    frozenset({"local"}): "local",
    frozenset({"local", "halo"}): "halo",
    frozenset({"local", "sharded"}): "sharded",
    frozenset({"local", "graph_partition"}): "graph_partition",
    frozenset({"graph_partition"}): "graph_partition",
    frozenset({"graph_partition", "halo"}): _GP_VS_SPATIAL,
    frozenset({"graph_partition", "sharded"}): _GP_VS_SPATIAL,
}


def merge_policies(a: StoragePolicy, b: StoragePolicy) -> StoragePolicy:
    """The policy of a pipeline that runs a block under ``a`` and a block under ``b``."""
    for policy in (a, b):
        if not isinstance(policy, _PolicyBase):
            raise SpecError(
                f"{policy!r} is not a storage policy; use one of "
                f"{', '.join(cls.__name__ for cls in POLICY_KINDS.values())}"
            )
    outcome = _MERGE_TABLE.get(frozenset({a.kind, b.kind}))
    if outcome is None:  # a policy kind of a third party: the policies themselves answer
        merged = a.merge_with(b) or b.merge_with(a)
        if merged is None:
            raise SpecError(
                f"no rule composes {type(a).__name__} (kind {a.kind!r}) with {type(b).__name__} "
                f"(kind {b.kind!r}); define merge_with(other) on the new policy, returning the "
                "merged policy (or raising SpecError when the two cannot share one pipeline)"
            )
        return merged
    if isinstance(outcome, _Incompatible):
        other = a.kind if b.is_graph_partition() else b.kind
        raise SpecError(
            f"cannot compose {type(a).__name__} with {type(b).__name__}: "
            + outcome.reason.format(other=other)
        )
    candidates = [p for p in (a, b) if p.kind == outcome]
    if outcome == "halo" and len(candidates) == 2:
        # one block building its own graph needs the full ghost shell; the other reads
        # the local list, which the shell does not change (NOTE [own graph])
        own_graph = a.builds_own_graph or b.builds_own_graph
        candidates = [replace(p, builds_own_graph=own_graph) for p in candidates]
    if len(candidates) == 2 and candidates[0] != candidates[1]:
        differing = [
            f"{name}: {candidates[0].rules()[name]!r} vs {candidates[1].rules()[name]!r}"
            for name in candidates[0].rules()
            if candidates[0].rules()[name] != candidates[1].rules()[name]
        ]
        raise SpecError(
            f"cannot compose two {type(a).__name__}s with different rules ({'; '.join(differing)}); "
            "one pipeline shares one layout, so give both blocks the same rules "
            "(dataclasses.replace(policy, ...)) or run them as separate distributed models"
        )
    return candidates[0]
