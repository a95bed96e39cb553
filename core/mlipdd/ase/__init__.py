"""ASE integration: `MLIPDDCalculator` (one process, or N persistent domain-decomposed ranks)
and `RankPool`, one set of ranks several calculators share (the images of an NEB)."""

from mlipdd.ase.calculator import MLIPDDCalculator
from mlipdd.distributed.rank_pool import RankPool, WorkerError

__all__ = ["MLIPDDCalculator", "RankPool", "WorkerError"]
