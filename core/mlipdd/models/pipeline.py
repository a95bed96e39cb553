"""A sum of models: short-range MLIP + dispersion + electrostatics as one wrapper.

The pipeline's energy, per-atom energies, forces and stress are the sums of its
members'. Any other output (AIMNet2's ``charges``) passes through when exactly one member
gives it; one given by several members is left out (which member's is meant is not
known). Its cutoff is the largest member cutoff; one neighbour list built with it
serves every member, because each model drops the edges longer than its own cutoff.
"""

from __future__ import annotations

import collections
import functools
import operator
from collections.abc import Iterable

import torch
from torch import nn

from mlipdd.data import Batch, InputError
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.neighbors import build_neighbor_list

_SUMMED = ("energy", "energies", "forces", "stress")


class PipelineModelWrapper(ModelWrapper):
    """Runs each wrapper in ``models`` on the same batch and sums their outputs."""

    def __init__(self, models: Iterable[ModelWrapper]):
        super().__init__()
        models = list(models)
        if not models:
            raise InputError(
                "PipelineModelWrapper needs at least one model; pass a list of wrappers"
            )
        for m in models:
            if not isinstance(m, ModelWrapper):
                raise InputError(
                    f"pipeline members must be ModelWrapper instances, got {type(m).__name__}; "
                    "wrap the model first"
                )
        self.models = nn.ModuleList(models)
        self.model_config = _combined_config([m.model_config for m in models])

    def distribution_spec(self, strategy=None):
        """The `|`-merge of the members' specs; ``None`` when no member declares one.

        Members answering ``None`` (let the core infer) are left out of the merge.
        """
        specs = [m.distribution_spec(strategy) for m in self.models]
        specs = [s for s in specs if s is not None]
        if not specs:
            return None
        return functools.reduce(operator.or_, specs)

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        if batch.neighbors is None:
            # one list for all members, on a view so the caller's batch is left alone
            view = type(batch)._from_dicts(dict(batch.node), dict(batch.system))
            view.neighbors = build_neighbor_list(batch, self.cutoff)
            batch = view
        total: dict[str, torch.Tensor] = {}
        present: dict[str, int] = {}
        for model in self.models:
            out = model(batch, compute_stress=compute_stress)
            if compute_stress and "stress" not in out:
                raise InputError(
                    f"stress was requested but pipeline member {type(model).__name__} gives none; "
                    "drop compute_stress or remove that member"
                )
            for key, value in out.items():
                summed = key in _SUMMED and key in total
                total[key] = total[key] + value if summed else value
                present[key] = present.get(key, 0) + 1
        # a partial sum would be silently wrong: keep only the sums every member gave, and
        # the other outputs that one member alone gave
        wanted = {k: len(self.models) if k in _SUMMED else 1 for k in present}
        return {k: v for k, v in total.items() if present[k] == wanted[k]}


def _combined_config(configs: list[ModelConfig]) -> ModelConfig:
    summed = functools.reduce(operator.and_, (c.outputs for c in configs))
    counts = collections.Counter(k for c in configs for k in c.outputs if k not in _SUMMED)
    outputs = frozenset(k for k in summed if k in _SUMMED) | {k for k, n in counts.items() if n == 1}
    autograd_outputs = functools.reduce(operator.or_, (c.autograd_outputs for c in configs))
    dtypes = tuple(
        d for d in configs[0].supported_dtypes if all(d in c.supported_dtypes for c in configs)
    )
    return ModelConfig(
        neighbor_config=NeighborConfig(cutoff=max(c.cutoff for c in configs)),
        outputs=outputs,
        autograd_outputs=autograd_outputs & outputs,
        supported_dtypes=dtypes,
    )
