"""`ChargeCoupled`: a charge-predicting model feeding an electrostatics wrapper.

The charge model's energy and the electrostatic energy of ITS charges are summed per
atom and differentiated once, so the forces include ``dE_elec/dq . dq/dr`` (charges
that follow the geometry), which a sum of independently differentiated blocks would
miss. A charge model provides its charges in one of two ways:

* ``atomic_energies_and_charges(batch, positions, cell) -> (energies, charges)``, or
* ``atomic_energies(batch, positions, cell)`` that leaves the charges, still attached
  to the autograd graph, in ``last_charges`` (`mlipdd.testing.QEqModel` does).

Under domain decomposition both parts run under one spec: the charge model's own spec
composed with the electrostatics wrapper's (``spec_a | spec_b``: adapters of both, and
the merge table's storage, so AIMNet2's sharded spec wins over Ewald's halo), or the
electrostatics' halo spec alone for a charge model without one (plain-torch message
passing with per-system sums is correct there: the dispatch all-reduces the sums).
"""

from __future__ import annotations

import torch
from mlipdd import Batch
from mlipdd.data import InputError
from mlipdd.models import ModelConfig, ModelWrapper, NeighborConfig, energy_forces_stress
from mlipdd.spec import OutputKind


class ChargeCoupled(ModelWrapper):
    def __init__(self, charge_model: ModelWrapper, electrostatics: ModelWrapper):
        super().__init__()
        if not hasattr(charge_model, "atomic_energies_and_charges") and not hasattr(charge_model, "last_charges"):
            raise InputError(
                f"{type(charge_model).__name__} does not expose its charges; give it "
                "atomic_energies_and_charges(batch, positions, cell) or a last_charges attribute"
            )
        self.charge_model = charge_model
        self.electrostatics = electrostatics
        configs = (charge_model.model_config, electrostatics.model_config)
        self.model_config = ModelConfig(
            NeighborConfig(max(c.cutoff for c in configs)),
            outputs=frozenset({"energy", "forces", "stress", "charges"}),
        )
        self._charges: torch.Tensor | None = None

    def distribution_spec(self, strategy=None):
        # Both parts run in one forward, so under one layout: the charge model's spec (its
        # adapters, e.g. AIMNet2's; sharded wins over halo in the merge table) composed
        # with the electrostatics' (a charge model without a spec runs on the latter's).
        spec = self.electrostatics.distribution_spec(strategy)
        own = self.charge_model.distribution_spec(strategy)
        if own is not None:
            composed = own | spec
            # A charge model that names one storage whatever the strategy (QEqModel: sharded)
            # but is plain torch runs on the electrostatics' layout when the requested
            # strategy takes that layout and not the composed one: keep the pair on it.
            if strategy is None or _accepts(strategy, composed) or not _accepts(strategy, spec):
                spec = composed
        return spec.replace(output_kinds={**spec.output_kinds, "charges": OutputKind.PER_NODE},
                            name=f"{spec.name}_charge_coupled")

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        out = energy_forces_stress(self, batch, compute_stress)
        out["charges"] = self._charges.detach()
        return out

    def atomic_energies(self, batch: Batch, positions, cell) -> torch.Tensor:
        model = self.charge_model
        if hasattr(model, "atomic_energies_and_charges"):
            energies, charges = model.atomic_energies_and_charges(batch, positions, cell)
        else:
            energies = model.atomic_energies(batch, positions, cell)
            charges = model.last_charges
        self._charges = charges
        return energies + self.electrostatics.atomic_energies(batch, positions, cell, charges=charges)


def _accepts(strategy, spec) -> bool:
    """Whether the strategy registered as ``strategy`` runs a model with ``spec``'s storage."""
    from mlipdd.plugins import get_strategy
    from mlipdd.strategy.fitting import strategy_name

    return get_strategy(strategy_name(strategy)).accepts(spec.distribution.policy)
