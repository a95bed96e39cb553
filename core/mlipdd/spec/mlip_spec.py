"""``DistributionSpec`` and ``MLIPSpec``: what a model declares about its distribution.

A wrapper returns one ``MLIPSpec`` from ``distribution_spec``; the core reads it and the
wrapper's forward stays single-process code. Specs are frozen values: derive variants
with :meth:`MLIPSpec.replace`, compose sub-model specs with ``|``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlipdd.spec._frozen import FrozenDict
from mlipdd.spec.adapters import JitAdapter, MethodAdapter, OpAdapter, PythonAdapter
from mlipdd.spec.errors import SpecError
from mlipdd.spec.kinds import OutputKind
from mlipdd.spec.policies import POLICY_KINDS, StoragePolicy, _PolicyBase, merge_policies

__all__ = ["DistributionSpec", "MLIPSpec"]

HelperAdapter = MethodAdapter | PythonAdapter | JitAdapter


def _as_tuple(items: Iterable[Any], allowed: tuple[type, ...], what: str) -> tuple[Any, ...]:
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise SpecError(f"DistributionSpec.{what} must be a tuple of adapters, not {items!r}")
    out: list[Any] = []
    for item in items:
        if not isinstance(item, allowed):
            names = " / ".join(cls.__name__ for cls in allowed)
            raise SpecError(f"DistributionSpec.{what} holds {item!r}; it takes {names} objects")
        out = _add_unique(out, item, what)
    return tuple(out)


def _add_unique(items: list[Any], item: Any, what: str) -> list[Any]:
    """Append ``item`` unless an equal one is there; a different adapter for the same
    target is a conflict (two declarations for one op or method)."""
    if item in items:
        return items
    for other in items:
        if other.target_name == item.target_name:
            raise SpecError(
                f"{what} declares {item.target_name} twice, differently: {other!r} and {item!r}; "
                "keep one adapter per op or method"
            )
    return [*items, item]


@dataclass(frozen=True)
class DistributionSpec:
    """Storage policy plus the adapters for code that dispatch cannot see through.

    ``custom_ops``: ``OpAdapter`` per opaque op. ``third_party_helpers``: Method/Python/
    Jit adapters installed while the model runs distributed.
    """

    policy: StoragePolicy
    custom_ops: tuple[OpAdapter, ...] = ()
    third_party_helpers: tuple[HelperAdapter, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.policy, _PolicyBase):
            if isinstance(self.policy, type) and issubclass(self.policy, _PolicyBase):
                fix = f"an instance: {self.policy.__name__}()"
            else:
                fix = "one of " + ", ".join(f"{c.__name__}()" for c in POLICY_KINDS.values())
            raise SpecError(f"DistributionSpec.policy is {self.policy!r}; pass {fix}")
        object.__setattr__(
            self, "custom_ops", _as_tuple(self.custom_ops, (OpAdapter,), "custom_ops")
        )
        object.__setattr__(
            self,
            "third_party_helpers",
            _as_tuple(
                self.third_party_helpers, (MethodAdapter, PythonAdapter), "third_party_helpers"
            ),
        )

    def __or__(self, other: DistributionSpec) -> DistributionSpec:
        if not isinstance(other, DistributionSpec):
            return NotImplemented
        ops = list(self.custom_ops)
        for op in other.custom_ops:
            ops = _add_unique(ops, op, "the composed custom_ops")
        helpers = list(self.third_party_helpers)
        for helper in other.third_party_helpers:
            helpers = _add_unique(helpers, helper, "the composed third_party_helpers")
        return DistributionSpec(
            merge_policies(self.policy, other.policy), tuple(ops), tuple(helpers)
        )


def _names(values: Iterable[str], what: str) -> frozenset[str]:
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise SpecError(f"MLIPSpec.{what} must be a set of output names, not {values!r}")
    values = frozenset(values)
    bad = [v for v in values if not isinstance(v, str) or not v]
    if bad:
        raise SpecError(f"MLIPSpec.{what} holds {bad!r}; output names are non-empty strings")
    return values


@dataclass(frozen=True)
class MLIPSpec:
    """Everything the core needs to run a model distributed.

    * ``distribution``: the ``DistributionSpec`` (policy and adapters).
    * ``output_kinds``: ``{output name: OutputKind}``; drives final consolidation
      (`mlipdd.strategy.outputs`: per-graph kinds stay replicated, per-node ones go to owners).
    * ``owned_only_outputs``: per-atom outputs already complete on their owner's rank
      (skip the ghost back-exchange).
    * ``all_reduce_outputs``: outputs that are per-rank partial sums (strain-trick
      stress) and need a final sum across ranks.
    * ``name``: for messages and reports.
    """

    distribution: DistributionSpec
    output_kinds: Mapping[str, OutputKind] = field(default_factory=FrozenDict)
    owned_only_outputs: frozenset[str] = frozenset()
    all_reduce_outputs: frozenset[str] = frozenset()
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.distribution, DistributionSpec):
            fix = (
                f"DistributionSpec(policy={self.distribution!r})"
                if isinstance(self.distribution, _PolicyBase)
                else "a DistributionSpec(policy=...)"
            )
            raise SpecError(f"MLIPSpec.distribution is {self.distribution!r}; pass {fix}")
        if not isinstance(self.output_kinds, Mapping):
            raise SpecError("MLIPSpec.output_kinds must be a dict {output name: OutputKind}")
        kinds = FrozenDict(
            {str(k): OutputKind.parse(v, output=str(k)) for k, v in self.output_kinds.items()}
        )
        object.__setattr__(self, "output_kinds", kinds)
        owned = _names(self.owned_only_outputs, "owned_only_outputs")
        reduced = _names(self.all_reduce_outputs, "all_reduce_outputs")
        object.__setattr__(self, "owned_only_outputs", owned)
        object.__setattr__(self, "all_reduce_outputs", reduced)
        if not isinstance(self.name, str):
            raise SpecError(f"MLIPSpec.name must be a str, not {self.name!r}")
        both = owned & reduced
        if both:
            raise SpecError(
                f"output(s) {sorted(both)} are both owned-only (already complete per rank) and "
                "all-reduced (per-rank partials); keep each in one of the two sets"
            )
        not_per_node = sorted(
            n
            for n in owned
            if kinds.get(n, OutputKind.UNKNOWN) in (OutputKind.PER_GRAPH, OutputKind.GLOBAL)
        )
        if not_per_node:
            raise SpecError(
                f"owned_only_outputs {not_per_node} are declared per-graph/global in output_kinds; "
                "owned-only applies to per-atom outputs: drop them from owned_only_outputs or fix "
                "their kind"
            )

    # ---- conveniences -------------------------------------------------------------------
    @property
    def policy(self) -> StoragePolicy:
        return self.distribution.policy

    def kind_of(self, output: str) -> OutputKind:
        return self.output_kinds.get(output, OutputKind.UNKNOWN)

    def replace(self, **changes: Any) -> MLIPSpec:
        """A copy with ``changes`` applied; ``policy=`` replaces the distribution's policy."""
        if "policy" in changes:
            distribution = changes.pop("distribution", self.distribution)
            changes["distribution"] = dataclasses.replace(
                distribution, policy=changes.pop("policy")
            )
        try:
            return dataclasses.replace(self, **changes)
        except TypeError as exc:
            known = ", ".join(f.name for f in dataclasses.fields(self))
            raise SpecError(f"MLIPSpec.replace: {exc}; fields are {known} (and policy)") from None

    # ---- composition --------------------------------------------------------------------
    def __or__(self, other: MLIPSpec) -> MLIPSpec:
        """The spec of a pipeline running a block under ``self`` and one under ``other``."""
        if not isinstance(other, MLIPSpec):
            return NotImplemented
        kinds = dict(self.output_kinds)
        for output, kind in other.output_kinds.items():
            if kinds.get(output, kind) is not kind:
                raise SpecError(
                    f"cannot compose specs {self.name or '(unnamed)'} and {other.name or '(unnamed)'}: "
                    f"output {output!r} is {kinds[output].name} in one and {kind.name} in the "
                    "other; a pipeline sums same-named outputs, so they must have one kind: "
                    "rename one model's output or fix its kind"
                )
            kinds[output] = kind
        return MLIPSpec(
            distribution=self.distribution | other.distribution,
            output_kinds=kinds,
            owned_only_outputs=self.owned_only_outputs | other.owned_only_outputs,
            all_reduce_outputs=self.all_reduce_outputs | other.all_reduce_outputs,
            name="+".join(n for n in (self.name, other.name) if n),
        )

    # ---- persistence --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        from mlipdd.spec.serialize import spec_to_dict

        return spec_to_dict(self)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the spec as versioned JSON (see ``mlipdd.spec.serialize``)."""
        from mlipdd.spec.serialize import save_spec

        save_spec(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, allow: Iterable[str] = ()) -> MLIPSpec:
        """Read a spec file. Only modules allow-listed by plugins (hook
        ``mlipdd_register_spec_modules``), ``mlipdd.spec`` and ``allow`` may be named."""
        from mlipdd.spec.serialize import load_spec

        return load_spec(path, allow=allow)
