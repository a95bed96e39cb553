"""Idiom-zoo models under the aten dispatch: exact or refused, never silently wrong.

A selection of `mlipdd.testing.idiom_zoo` (the full table, 55 models x 3 systems x 2-4
ranks, is docs/idiom_zoo.md, written by ``python -m mlipdd.testing.idiom_zoo``): the ones
that were silently wrong under this dispatch before a rule or a refusal (torch.cov's
local count, an average degree from sizes, a half list by comparing row numbers), the
reductions through views, the segment and per-system idioms, and controls. Each case
is classified like the zoo's (one process vs spawned gloo ranks, 1e-10) and must come
out as the table says: ``exact`` stays exact, ``refused`` stays refused.
"""

from __future__ import annotations

import pytest
from mlipdd.spec.presets import SPEC_MPNN_HALO
from mlipdd.testing.conformance import distributed_outputs
from mlipdd.testing.idiom_zoo import SYSTEMS, ZOO
from mlipdd.testing.idiom_zoo.classifier import selection_outcomes

EXPECTED = {
    "SchNetLike": "exact", "PaiNNLike": "exact", "LayerNormFeatures": "exact", "PermutedAtomSum": "exact",
    "NormalizeOverAtoms": "exact", "GramEinsum": "exact", "ElementMeans": "exact", "UniqueSpeciesMeans": "exact",
    "GCNDegreeNorm": "exact", "PerSystemMeanByBincount": "exact", "EdgeVectorForces": "exact",
    "Covariance": "refused", "AverageNeighbourCount": "refused", "HalfListPairs": "refused",
    "TransposeMean": "exact", "SelfLoops": "refused", "FirstAtomContext": "refused", "QEqIndexPut": "refused",
}


def _run_case(rank, world_size, case):
    model, system = case
    options = {"strategy": "halo", "skin": 0.0}
    out = distributed_outputs(rank, world_size, ZOO[model], SYSTEMS[system](), options, True, SPEC_MPNN_HALO)
    return {k: out[k] for k in ("atom_ids", "energy", "forces", "stress")}


@pytest.mark.mlipdd_conformance(world_sizes=(2,))
def test_zoo_selection_exact_or_refused(world_size):
    outcomes = selection_outcomes(_run_case, world_size, EXPECTED)
    got = {model: outcome for model, (outcome, _) in outcomes.items()}
    assert got == EXPECTED, {m: outcomes[m] for m in EXPECTED if got[m] != EXPECTED[m]}
