"""mlipdd plugin: AIMNet2 models (aimnet), with neural charge equilibration and Coulomb.

`AIMNet2Wrapper` wraps aimnet's `AIMNet2` (a model object, an aimnet v2 ``.pt`` file or
a registry name); `SPEC_AIMNET2_SHARDED` (default) and `SPEC_AIMNET2_HALO` run it under
domain decomposition. Heavy imports (aimnet, warp) happen on use, not on import of
this package.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["SPEC_AIMNET2_HALO", "SPEC_AIMNET2_SHARDED", "AIMNet2Wrapper", "__version__"]


def __getattr__(name: str):
    if name == "AIMNet2Wrapper":
        from mlipdd_aimnet2.wrapper import AIMNet2Wrapper

        return AIMNet2Wrapper
    if name == "SPEC_AIMNET2_SHARDED":
        from mlipdd_aimnet2.spec import aimnet2_sharded_spec

        return aimnet2_sharded_spec()
    if name == "SPEC_AIMNET2_HALO":
        from mlipdd_aimnet2.spec import aimnet2_halo_spec

        return aimnet2_halo_spec()
    raise AttributeError(name)
