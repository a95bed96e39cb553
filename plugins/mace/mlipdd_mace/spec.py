"""The distribution spec MACE runs under: the core's halo preset for MPNNs.

MACE needs nothing beyond `SPEC_MPNN_HALO` (no opaque kernels on the e3nn path: every
scatter and per-system sum goes through ordinary torch ops the core dispatches).
"""

from __future__ import annotations


def mpnn_halo_preset():
    """``mlipdd.spec.SPEC_MPNN_HALO``, or ``None`` for a core that does not have it (yet)."""
    try:
        from mlipdd.spec import SPEC_MPNN_HALO
    except ImportError:
        return None
    return SPEC_MPNN_HALO
