"""The spec layer: what a model declares about how it distributes.

Declarations only; nothing here runs collectives or knows about models, dynamics or
plugins (the spec-file allow-list asks the plugin registry lazily).

* ``MLIPSpec`` / ``DistributionSpec``: the declaration a wrapper returns.
* Policies: ``HaloStoragePolicy``, ``ShardedStoragePolicy``, ``LocalPolicy``,
  ``GraphPartitionPolicy``; composed with ``merge_policies`` (``spec_a | spec_b``).
* ``OutputKind``: per-node / per-graph / global / unknown outputs.
* Adapters: ``OpAdapter`` (opaque ops, with transforms), ``MethodAdapter``,
  ``PythonAdapter``, ``JitAdapter`` (patches, installed with ``installed``).
* Presets: ``SPEC_MPNN_HALO``, ``SPEC_LJ_HALO``, ``SPEC_MPNN_SHARDED``,
  ``SPEC_MPNN_GP``, ``SPEC_LOCAL``.
"""

from mlipdd.spec.adapters import JitAdapter, MethodAdapter, OpAdapter, PythonAdapter
from mlipdd.spec.errors import SpecError
from mlipdd.spec.kinds import OutputKind
from mlipdd.spec.mlip_spec import DistributionSpec, MLIPSpec
from mlipdd.spec.patching import adapter_context, installed
from mlipdd.spec.policies import (
    GraphPartitionPolicy,
    HaloStoragePolicy,
    LocalPolicy,
    ShardedStoragePolicy,
    StoragePolicy,
    merge_policies,
)
from mlipdd.spec.presets import (
    PRESETS,
    SPEC_LJ_HALO,
    SPEC_LOCAL,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    SPEC_MPNN_SHARDED,
)
from mlipdd.spec.transforms import (
    AllReduceSum,
    GatherInputs,
    GatherInputsFull,
    ScatterOutputs,
    SliceOutputsOwned,
    SliceOwned,
    Transform,
)

__all__ = ["PRESETS", "SPEC_LJ_HALO", "SPEC_LOCAL", "SPEC_MPNN_GP", "SPEC_MPNN_HALO",
           "SPEC_MPNN_SHARDED", "AllReduceSum", "DistributionSpec", "GatherInputs",
           "GatherInputsFull", "GraphPartitionPolicy", "HaloStoragePolicy", "JitAdapter",
           "LocalPolicy", "MLIPSpec", "MethodAdapter", "OpAdapter", "OutputKind", "PythonAdapter",
           "ScatterOutputs", "ShardedStoragePolicy", "SliceOutputsOwned", "SliceOwned", "SpecError",
           "StoragePolicy", "Transform", "adapter_context", "installed", "merge_policies"]
