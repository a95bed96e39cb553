"""ASE integration: `MLIPDDCalculator` (one process, or N persistent domain-decomposed ranks)."""

from mlipdd.ase.calculator import MLIPDDCalculator
from mlipdd.distributed.rank_pool import WorkerError

__all__ = ["MLIPDDCalculator", "WorkerError"]
