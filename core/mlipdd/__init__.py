"""mlipdd: domain decomposition for machine-learned interatomic potentials."""

from mlipdd.data import AtomicData, Batch, InputError

__version__ = "0.1.0"
__all__ = ["AtomicData", "Batch", "InputError", "__version__"]
from mlipdd.hookspecs import hookimpl as hookimpl  # re-export for plugin authors
