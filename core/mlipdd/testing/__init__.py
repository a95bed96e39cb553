"""Conformance kit: single process vs spawned ranks, for our plugins and third parties'."""

from mlipdd.testing.conformance import ConformanceResult, check_conformance, check_conformance_cases
from mlipdd.testing.spawn import RankFailure, run_ranks
from mlipdd.testing.suite import conformance_suite
from mlipdd.testing.systems import AWKWARD_CELLS, UNEVEN_CELLS

__all__ = ["AWKWARD_CELLS", "UNEVEN_CELLS", "ConformanceResult", "RankFailure", "check_conformance",
           "check_conformance_cases", "conformance_suite", "run_ranks"]
