"""Real packages' models (`mlipdd.testing.real_packages`: schnetpack's SchNet and PaiNN,
orb-models' orb-v3, sevenn's SevenNet, matgl's TensorNet) under `DistributedModel`: every case equals one
process to 1e-10 or is refused.

The full matrix (every system at every rank count) is docs/real_packages.md, written
by ``python -m mlipdd.testing.real_packages``. Here each rank count runs one system, so
that 2, 3 and 4 ranks and the three systems are all covered at a few seconds a case:
each model x halo/sharded storage, on one spawned group per rank count, against
references computed once.
"""

from __future__ import annotations

import pytest
from mlipdd.testing.real_packages import REAL_MODELS, available
from mlipdd.testing.real_packages.classify import classify_world_size, references, validation

SYSTEM_AT = {2: "triclinic", 3: "own_images", 4: "slab"}  # each system once, each rank count once
MODELS = [name for name, real in REAL_MODELS.items() if real.package == "schnetpack"]
# Exact everywhere: Atomwise's ``maxm = int(idx_m[-1]) + 1`` reads ``idx_m[-1]`` as the whole
# system's last atom (NOTE [a row by its global number]), also on a sharded rank owning no atom.
EXPECTED = {"halo": "exact", "sharded": "exact"}


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
        outcomes = {r.strategy: r.outcome for r in results if r.model == model}
        assert outcomes == EXPECTED, [r for r in results if r.model == model]


@pytest.mark.parametrize("model", MODELS)
def test_validation_passes_an_exact_model(model):
    """trace_and_validate with its default sample: exact models pass (a wrong one must fail)."""
    assert validation(model, strategies=("halo",)) == {"halo": (True, "")}


# orb-v3 and SevenNet at 2 and 3 ranks (docs/real_packages.md). sevenn's ForceStressOutputFromEdge
# scatters into ``torch.zeros(sum(num_atoms), 3)``, the whole system's size: refused, naming the fix.
# orb-v3 conservative is exact under sharded storage (its one-system ``bmm(positions,
# displacement[per_node])`` and segment ids expanded to the rows: NOTE [a batch factor equal along
# the rows], NOTE [an expand of equal rows]); where a halo rank holds more rows than the system
# has atoms, orb's code on replicated values fails first (the ``per_node_graph_indices`` of a
# searchsorted over ``arange(len(positions))``): torch's error, wrapped in a refusal that names the
# op and the cause (NOTE [failed on replicated values] in mlipdd.shard.aten.rules), on every rank.
# orb-v3 direct subtracts per-system means broadcast to the whole system's atoms
# (``repeat_interleave(means, n_node)``, with a gradient): refused at that subtraction.
NEW_MODELS = ["orb-v3 conservative", "orb-v3 direct", "sevenn SevenNet"]
GLOBAL_INDEX = "AtenRefusal: `aten::index.Tensor` failed on this rank (IndexError"
WHOLE_SYSTEM_SUB = "AtenRefusal: mlipdd aten dispatch refuses `aten::sub.Tensor`"
SCATTER = "AtenRefusal: mlipdd aten dispatch refuses `aten::scatter_reduce_.two`"
OUTCOMES = {
    ("orb-v3 conservative", "halo"): ("refused", GLOBAL_INDEX),
    ("orb-v3 conservative", "sharded"): ("exact", ""),
    ("orb-v3 direct", "halo"): ("refused", WHOLE_SYSTEM_SUB),
    ("orb-v3 direct", "sharded"): ("refused", WHOLE_SYSTEM_SUB),
    ("sevenn SevenNet", "halo"): ("refused", SCATTER),
    ("sevenn SevenNet", "sharded"): ("refused", SCATTER),
}


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3))
def test_orb_and_sevennet_are_exact_or_refused_on_every_rank(world_size):
    missing = [why for name in NEW_MODELS if (why := available(name))]
    assert not missing, f"{missing}: install the test extra (pip install -e '.[test]')"
    system = SYSTEM_AT[world_size]
    results = classify_world_size(NEW_MODELS, world_size, references(NEW_MODELS, (system,)), systems=(system,))
    got = {(r.model, r.strategy): (r.outcome, r.detail) for r in results}
    assert got.keys() == OUTCOMES.keys()
    for key, (outcome, start) in OUTCOMES.items():
        assert got[key][0] == outcome and got[key][1].startswith(start), (key, got[key])


# matgl's TensorNet under its Potential: exact. The backward of the Potential's
# ``lattice[node_batch]`` (``node_batch = torch.zeros(g.num_nodes)``) is an index_put of the rows'
# gradients into the lattice by that plain index, equal in every row: a sum over the rows (NOTE [a
# uniform index of rows]); it was refused as "a scatter by a plain index".
TENSORNET = "matgl TensorNet"
TENSORNET_EXPECTED = {"halo": "exact", "sharded": "exact"}


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3))
def test_tensornet_exact(world_size):
    assert available(TENSORNET) is None, available(TENSORNET)
    system = SYSTEM_AT[world_size]
    results = classify_world_size([TENSORNET], world_size, references([TENSORNET], (system,)), systems=(system,))
    assert {r.strategy: r.outcome for r in results} == TENSORNET_EXPECTED, results
