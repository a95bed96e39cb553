"""Ready-made specs for the common model families.

The built-in plugin (``mlipdd.builtin_plugin``) registers every entry of `PRESETS`
through the preset hook, like any third-party plugin registers its own, so
``mlipdd.plugins.get_preset(name)`` is the one lookup for built-in and plugin presets.
A new preset here goes into `PRESETS` too (a test checks).
"""

from __future__ import annotations

from mlipdd.spec.kinds import OutputKind
from mlipdd.spec.mlip_spec import DistributionSpec, MLIPSpec
from mlipdd.spec.policies import (
    GraphPartitionPolicy,
    HaloStoragePolicy,
    LocalPolicy,
    ShardedStoragePolicy,
)

__all__ = ["PRESETS", "SPEC_LJ_HALO", "SPEC_LOCAL", "SPEC_MPNN_GP", "SPEC_MPNN_HALO",
           "SPEC_MPNN_SHARDED"]

# energy and stress are per system; forces and per-atom energies per atom. Stress from
# the strain trick differentiates a replicated energy, so each rank holds a partial.
_MLIP_OUTPUTS = {
    "energy": OutputKind.PER_GRAPH,
    "forces": OutputKind.PER_NODE,
    "stress": OutputKind.PER_GRAPH,
    "energies": OutputKind.PER_NODE,
}
_STRAIN_STRESS = frozenset({"stress"})

SPEC_MPNN_HALO = MLIPSpec(
    distribution=DistributionSpec(HaloStoragePolicy()),
    output_kinds=_MLIP_OUTPUTS,
    all_reduce_outputs=_STRAIN_STRESS,
    name="mpnn_halo",
)
"""Scatter-heavy message passing with autograd forces (MACE, NequIP, any plain-torch
MPNN): halo storage, halo-corrected scatters, per-system reductions."""

SPEC_LJ_HALO = SPEC_MPNN_HALO.replace(name="lj_halo")
"""The Lennard-Jones reference model: halo storage, same outputs as SPEC_MPNN_HALO.

A pair potential written in plain torch whose forces come from autograd is an MPNN
with one layer as far as distribution goes, so SPEC_MPNN_HALO is just as correct for
it; this preset exists so the reference model has a name of its own."""

SPEC_MPNN_SHARDED = SPEC_MPNN_HALO.replace(
    distribution=DistributionSpec(ShardedStoragePolicy()), name="mpnn_sharded"
)
"""Models with a per-system reduction inside every layer (charge equilibration,
AIMNet2): each rank stores only its owned rows."""

SPEC_MPNN_GP = SPEC_MPNN_HALO.replace(
    distribution=DistributionSpec(GraphPartitionPolicy()), name="mpnn_gp"
)
"""Node-partition graph partition: every rank holds all positions and runs the layers on
its owned block of nodes. A model family adds its own adapters on top."""

SPEC_LOCAL = MLIPSpec(
    distribution=DistributionSpec(LocalPolicy()),
    output_kinds=_MLIP_OUTPUTS,
    name="local",
)
"""No distribution: everything stays on the rank (single-process runs, or a block whose
inputs are already complete everywhere)."""

PRESETS: dict[str, MLIPSpec] = {
    "SPEC_MPNN_HALO": SPEC_MPNN_HALO,
    "SPEC_LJ_HALO": SPEC_LJ_HALO,
    "SPEC_MPNN_SHARDED": SPEC_MPNN_SHARDED,
    "SPEC_MPNN_GP": SPEC_MPNN_GP,
    "SPEC_LOCAL": SPEC_LOCAL,
}
