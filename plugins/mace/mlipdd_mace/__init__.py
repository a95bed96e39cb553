"""mlipdd plugin for MACE models (mace-torch): `MACEWrapper` and its hooks.

Importing the package does not import mace; `MACEWrapper` is loaded on first use.
"""

from mlipdd_mace.versions import SUPPORTED_E3NN, SUPPORTED_MACE

__version__ = "0.1.0"
__all__ = ["SUPPORTED_E3NN", "SUPPORTED_MACE", "MACEWrapper", "__version__"]


def __getattr__(name):
    if name == "MACEWrapper":
        from mlipdd_mace.wrapper import MACEWrapper

        return MACEWrapper
    raise AttributeError(name)
