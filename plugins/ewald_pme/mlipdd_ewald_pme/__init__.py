"""mlipdd plugin: Ewald, particle-mesh Ewald, damped shifted force and DFT-D3 as mlipdd
model wrappers (charges from the batch, by element, or from an upstream charge model).

The names below are imported on first use: the plugin entry point
(`mlipdd_ewald_pme.plugin`) imports this package, and PME pulls in Warp through
nvalchemiops, which `mlipdd plugins` should not pay for.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "BornMayerWrapper": "born_mayer",
    "ChargeCoupled": "coupled",
    "D3Wrapper": "d3",
    "DSFWrapper": "wrappers",
    "EwaldWrapper": "wrappers",
    "PMEWrapper": "wrappers",
    "SPEC_DFTD3_HALO": "spec",
    "SPEC_DSF_HALO": "spec",
    "SPEC_EWALD_HALO": "spec",
    "SPEC_PME_HALO": "spec",
}
__all__ = sorted(_EXPORTS)  # noqa: PLE0605 - the lazily exported names


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mlipdd_ewald_pme' has no attribute {name!r}")
    return getattr(import_module(f"mlipdd_ewald_pme.{_EXPORTS[name]}"), name)
