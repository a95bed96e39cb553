"""mlipdd plugin: Meta's UMA models (fairchem-core eSCN-MD backbone).

`UMAWrapper` wraps a fairchem model object, an inference checkpoint or a released
model by name; `SPEC_UMA_HALO` runs it under the spatial halo strategy and
``wrapper.distribution_spec("graph_partition")`` under graph partition.
Heavy imports (fairchem) happen on use, not on import of this package.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["SPEC_UMA_HALO", "UMAWrapper", "__version__"]


def __getattr__(name: str):
    if name == "UMAWrapper":
        from mlipdd_uma.wrapper import UMAWrapper

        return UMAWrapper
    if name == "SPEC_UMA_HALO":
        from mlipdd_uma.spec import uma_halo_spec

        return uma_halo_spec()
    raise AttributeError(name)
