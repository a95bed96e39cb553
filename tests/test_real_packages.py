"""Real packages' models (schnetpack's SchNet and PaiNN, `mlipdd.testing.real_packages`)
under `DistributedModel`: every case equals one process to 1e-10 or is refused by name.

The full matrix (every system at every rank count) is docs/real_packages.md, written
by ``python -m mlipdd.testing.real_packages``. Here each rank count runs one system, so
that 2, 3 and 4 ranks and the three systems are all covered at a few seconds a case:
both models x halo/sharded storage x torch-function/aten dispatch, on one spawned group per
rank count, against references computed once.
"""

from __future__ import annotations

import pytest
from mlipdd.testing.real_packages import REAL_MODELS, available
from mlipdd.testing.real_packages.classify import classify_world_size, references, validation

SYSTEM_AT = {2: "triclinic", 3: "own_images", 4: "slab"}  # each system once, each rank count once
MODELS = list(REAL_MODELS)
# What the table says. The torch-function dispatch runs schnetpack exactly, except where a
# sharded rank owns no atom (4 ranks, slab): Atomwise's ``maxm = int(idx_m[-1]) + 1`` then
# reads past that rank's rows, refused naming that line. The aten dispatch (the default) reads
# ``idx_m[-1]`` as the whole system's last atom (NOTE [a row by its global number]): exact everywhere.
NAMED = {"int(idx_m[-1])"}
EXPECTED = {("halo", "function"): "exact", ("halo", "aten"): "exact", ("sharded", "function"): "exact",
            ("sharded", "aten"): "exact"}
EMPTY_SHARDED_RANK = {("sharded", "function"): "UninferredRowsError"}


@pytest.fixture(scope="module")
def refs():
    missing = [why for name in MODELS if (why := available(name))]
    assert not missing, f"{missing}: install the test extra (pip install -e '.[test]')"
    return references(MODELS, sorted(set(SYSTEM_AT.values())))


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_exact_or_refused_by_name(world_size, refs):
    system = SYSTEM_AT.get(world_size, "triclinic")
    results = classify_world_size(MODELS, world_size, refs, systems=(system,))
    for model in MODELS:
        outcomes = {(r.strategy, r.dispatch): r.outcome for r in results if r.model == model}
        expected = dict(EXPECTED)
        if system == "slab" and world_size == 4:
            expected.update(dict.fromkeys(EMPTY_SHARDED_RANK, "refused"))
        assert outcomes == expected, [r for r in results if r.model == model]
    for r in results:
        if r.outcome != "refused":
            continue
        if system == "slab" and world_size == 4 and (r.strategy, r.dispatch) in EMPTY_SHARDED_RANK:
            named = any(name in r.detail for name in NAMED) and "Fix:" in r.detail
            assert named or r.detail.startswith(EMPTY_SHARDED_RANK[r.strategy, r.dispatch]), r.detail
        else:  # the refusal names the op and says what to do
            assert any(name in r.detail for name in NAMED) and "Fix:" in r.detail, r.detail


@pytest.mark.parametrize("model", MODELS)
def test_validation_passes_an_exact_model(model):
    """trace_and_validate with its default sample: exact models pass (a wrong one must fail)."""
    assert validation(model, strategies=("halo",)) == {"halo": (True, "")}
