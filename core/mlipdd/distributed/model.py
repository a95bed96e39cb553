"""`DistributedModel`: runs an unchanged model wrapper on this rank's subdomain.

Per call: agree on input validity -> (rebuild: migrate, halo plan, local list) ->
padded positions as a ShardTensor -> the wrapper's own forward, with the spec's
adapters installed -> outputs consolidated by kind (forces back to owners, energy
already replicated, partial stress summed).
"""

from __future__ import annotations

import torch
from torch import nn

from mlipdd.data import Batch, InputError
from mlipdd.distributed.config import DomainConfig, StrategyKind
from mlipdd.shard.agreement import agree_on_errors, any_rank, check_together, fail_together
from mlipdd.spec.patching import installed
from mlipdd.shard import ShardMeta, ShardTensor, all_reduce_sum, halo_accumulate, local
from mlipdd.strategy.halo import HaloStrategy, check_domain_inputs


def resolve_spec(model, strategy: StrategyKind, spec=None):
    """The spec to run under: given, the wrapper's own, or the MPNN halo default."""
    if spec is None:
        spec = model.distribution_spec(strategy)
    if spec is None:
        from mlipdd.spec.presets import SPEC_MPNN_HALO

        spec = SPEC_MPNN_HALO
    return spec


class DistributedModel(nn.Module):
    """``DistributedModel(model, config, spec=None)``; call it on this rank's owned batch.

    Returns ``energy`` (n_systems,) replicated on every rank, ``forces`` for the owned
    atoms, ``stress`` (n_systems, 3, 3) replicated when asked, and any other per-atom
    output for the owned atoms. The owned batch is updated in place when atoms migrate
    (at neighbour-list rebuilds), so keep using the same object.
    """

    def __init__(self, model, config: DomainConfig, spec=None, group=None):
        super().__init__()
        if not isinstance(model, nn.Module) or not hasattr(model, "model_config"):
            from mlipdd.plugins import wrap_model

            model = wrap_model(model)
        self.model = model
        self.config = config
        self.group = group
        if config.strategy != StrategyKind.HALO:
            raise NotImplementedError(
                f"strategy {config.strategy.value!r} is not available yet; use StrategyKind.HALO"
            )
        self.spec = resolve_spec(model, config.strategy, spec)
        policy = self.spec.distribution.policy
        if not (policy.is_halo() or policy.is_local()):
            raise InputError(
                f"the spec's policy {type(policy).__name__} does not fit the halo strategy; "
                "use a halo spec or choose the matching DomainConfig.strategy"
            )
        if config.cutoff < model.cutoff - 1e-12:
            raise InputError(
                f"DomainConfig.cutoff {config.cutoff} is smaller than the model's cutoff "
                f"{model.cutoff}; ghosts would be missing: use DomainConfig(cutoff=model.cutoff)"
            )
        self.strategy = HaloStrategy(config.halo_width, config.grid, group)
        self.last_padded: Batch | None = None

    @property
    def cutoff(self) -> float:
        return self.model.cutoff

    def partition(self, full: Batch | None, device=None) -> Batch:
        """Rank 0 holds the full system (None elsewhere); returns this rank's owned atoms,
        on ``device`` (default: where the model's parameters live)."""
        if device is None:
            tensor = next(iter([*self.model.parameters(), *self.model.buffers()]), None)
            device = tensor.device if tensor is not None else None
        with fail_together(self.group):
            return self.strategy.partition(full, device)

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        with fail_together(self.group):
            check_together(_check_positions, batch, group=self.group)
            if any_rank(self.strategy.needs_rebuild(batch, self.config.skin), self.group):
                check_together(check_domain_inputs, batch, group=self.group)
                self.strategy.migrate(batch)
                self.strategy.build(batch, self.config.cutoff + self.config.skin)
            padded, meta = self._padded_batch(batch)
            error, outputs = None, None
            with installed(self.spec):
                outputs = self.model(padded, compute_stress=compute_stress)
            result = self._consolidate(outputs, meta)
            error = _check_outputs(result)
            agree_on_errors(error, self.group)
            return result

    # ---- internals ----------------------------------------------------------------------
    def _padded_batch(self, batch: Batch) -> tuple[Batch, ShardMeta]:
        state = self.strategy.state
        policy = self.spec.distribution.policy
        meta = ShardMeta(
            plan=state.plan,
            n_systems=batch.num_systems,
            n_edges=state.neighbors.num_edges,
            scatter_rule="local" if policy.is_local() else policy.scatter,
            gather_rule="local" if policy.is_local() else policy.gather,
            system_reductions=policy.system_reductions,
            group=self.group,
        )
        positions = batch.positions.detach().requires_grad_(True)
        padded_positions = self.strategy.padded_positions(positions, batch.cell, state)
        node = {
            "positions": ShardTensor.wrap(padded_positions, meta),
            "atomic_numbers": ShardTensor.wrap(torch.cat([batch.atomic_numbers, state.ghost_numbers]), meta),
            "batch": torch.cat([batch.batch, state.ghost_system]),
            "atom_ids": torch.cat([batch.atom_ids, state.ghost_ids]),
        }
        padded = Batch._from_dicts(node, dict(batch.system))
        padded.neighbors = state.neighbors
        padded.n_owned = batch.num_atoms  # for diagnostics; models must not need it
        self.last_padded = padded
        return padded, meta

    def _consolidate(self, outputs: dict, meta: ShardMeta) -> dict[str, torch.Tensor]:
        spec = self.spec
        autograd_outputs = getattr(self.model.model_config, "autograd_outputs", frozenset())
        result = {}
        for name, value in outputs.items():
            if not torch.is_tensor(value):
                result[name] = value
                continue
            value = local(value).detach()
            if name in spec.all_reduce_outputs:
                value = all_reduce_sum(value, self.group)
            elif value.dim() > 0 and value.shape[0] == meta.n_padded:
                # per-atom: derivatives hold partials on ghost rows, values hold mirrors
                if name in autograd_outputs and name not in spec.owned_only_outputs:
                    value = halo_accumulate(value, meta.plan)
                value = value[: meta.n_owned]
            result[name] = value
        return result


def _check_positions(batch: Batch) -> None:
    """The per-step check (cheap); the full validation runs at every rebuild."""
    if not torch.isfinite(batch.positions).all():
        bad = torch.nonzero(~torch.isfinite(batch.positions).all(1)).flatten()[:5]
        raise InputError(
            f"positions contain NaN or inf (atom ids {batch.atom_ids[bad].tolist()}); the system blew "
            "up or was built wrongly: check the structure, or lower the time step in MD"
        )


def _check_outputs(result: dict) -> BaseException | None:
    for name in ("energy", "forces", "stress"):
        value = result.get(name)
        if value is not None and not torch.isfinite(value).all():
            return FloatingPointError(
                f"the distributed {name} contains NaN/inf. If the single-process model is finite, "
                "the usual cause is a dropped in-place scatter result: write "
                "`x = x.scatter_add_(...)` / `x = x.index_add_(...)` instead of calling it for its "
                "side effect; run mlipdd.validate.trace_and_validate to locate it"
            )
    return None
