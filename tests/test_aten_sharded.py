"""The aten-level dispatch under SHARDED storage (``DomainConfig(strategy="sharded")``).

Each rank stores its owned rows only; the edge index addresses ``[owned | request
table]``, a read by it fetches remote rows from their owners and a scatter by it
delivers remote sums to them (NOTE [aten sharded storage]). One spawned group per world
size runs every check: LJ, the tests' ToyMPNN and MACE (random weights) equal one
process to 1e-10 relative on energy, forces and stress, float64, in a triclinic cell, a
cell where a rank sees its own images, a slab cut along its vacuum (and LJ on a batch of
two systems); the run is the aten sharded strategy, storing no ghost row; and an op
without a rule is refused by name on every rank.
"""

from __future__ import annotations

import pytest
import torch
from mlipdd.distributed import DomainConfig
from mlipdd.models.lj import LennardJones
from mlipdd.spec.presets import SPEC_MPNN_SHARDED
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import build_model, gather_by_id, relative_difference
from mlipdd.testing.idiom_zoo import SYSTEMS, ZOO
from mlipdd.testing.idiom_zoo.classifier import selection_outcomes
from mlipdd.testing.systems import slab, small_cell, triclinic, two_systems
from mlipdd.testing.toy_models import ToyMPNN

SHARDED = {"strategy": "sharded"}
TOLERANCE = 1e-10


def lj():
    return LennardJones(epsilon={18: 0.0104, 10: 0.0031}, sigma={18: 3.4, 10: 2.75}, cutoff=7.0)


def small_mace():
    from mlipdd_mace import MACEWrapper
    from mlipdd_mace.testing import random_mace

    return MACEWrapper(random_mace(elements=(14,), r_max=4.0, channels=8, max_ell=1, correlation=2,
                                   num_interactions=2, dtype=torch.float64, seed=0)).eval()


class SortsAtoms(LennardJones):
    """An op without a rule on atom rows (a sort of per-atom energies)."""

    def atomic_energies(self, batch, positions, cell):
        return torch.sort(super().atomic_energies(batch, positions, cell)).values


def cases(world_size: int) -> list[tuple[str, object, object, dict]]:
    """(name, model factory, batch, DomainConfig options); a slab is cut along its vacuum."""
    cut = {"grid": (1, 1, world_size)}
    silicon = {"species": (14,), "spacing": 2.4}  # rattled: a perfect crystal has zero forces
    return [
        ("lj triclinic", lj, triclinic(species=(18, 10), reps=4), {}),
        ("lj own images", lj, small_cell(species=(18, 10), reps=2), {}),
        ("lj slab", lj, slab(species=(18, 10), reps=(4, 4, 3)), cut),
        ("lj two systems", lj, two_systems(species=(18, 10)), {}),
        ("mpnn triclinic", ToyMPNN, triclinic(reps=4), {}),
        ("mpnn own images", ToyMPNN, small_cell(reps=2), {}),
        ("mpnn slab", ToyMPNN, slab(reps=(4, 4, 3)), cut),
        ("mace triclinic", small_mace, triclinic(**silicon, reps=4), {"skin": 0.0}),
        ("mace own images", small_mace, small_cell(**silicon, reps=3), {"skin": 0.0}),
        # vacuum 6 A (> the 4 A cutoff) leaves no rank empty at 2-4 ranks: MACE's own
        # out.view(n, -1) cannot run on zero atoms (refused by name on an empty rank)
        ("mace slab", small_mace, slab(**silicon, reps=(3, 3, 6), vacuum=6.0), {"skin": 0.0, **cut}),
    ]


def _all_checks(rank, world_size):
    """Worker: every case's owned results and what the strategy stored, then (last: it
    tears the group down) the refusal's message as this rank saw it."""
    from mlipdd.distributed import DistributedModel

    out = []
    for _, factory, batch, options in cases(world_size):
        model = build_model(factory, "cpu")
        dm = DistributedModel(model, DomainConfig(**{"cutoff": model.cutoff, **SHARDED, **options}))
        owned = dm.partition(batch if rank == 0 else None)
        result = dm(owned, compute_stress=True)
        out.append({"atom_ids": owned.atom_ids, "energy": result["energy"], "forces": result["forces"],
                    "stress": result["stress"], "strategy": type(dm.strategy).__name__,
                    "stored": dm.strategy.report()["stored_rows"], "n_owned": owned.num_atoms})
    dm = DistributedModel(SortsAtoms(epsilon=0.0104, sigma=3.4, cutoff=7.0), DomainConfig(cutoff=7.0, **SHARDED))
    owned = dm.partition(triclinic(reps=3) if rank == 0 else None)
    try:
        dm(owned)
        refusal = None
    except Exception as exc:  # noqa: BLE001 - the message is the check
        refusal = f"{type(exc).__name__}: {exc}"
    return out, refusal


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_aten_sharded_equals_one_process(world_size):
    per_rank = run_ranks(_all_checks, world_size, timeout=600.0)
    for i, (name, factory, batch, _) in enumerate(cases(world_size)):
        reference = build_model(factory, "cpu")(batch.clone(), compute_stress=True)
        parts = [results[i] for results, _ in per_rank]
        assert {p["strategy"] for p in parts} == {"ShardedStrategy"}, name
        assert all(p["stored"]["owned"] == p["n_owned"] for p in parts), name  # owned rows only
        ids = torch.cat([p["atom_ids"] for p in parts])
        assert torch.equal(ids.sort().values, batch.atom_ids.sort().values), f"{name}: atoms lost or duplicated"
        got = {"energy": parts[0]["energy"], "forces": gather_by_id(parts, "forces", batch.num_atoms),
               "stress": parts[0]["stress"]}
        for key, value in got.items():
            diff = relative_difference(value, reference[key].detach())
            assert diff < TOLERANCE, (name, key, diff)
        for p in parts[1:]:
            assert torch.equal(p["energy"], parts[0]["energy"]), f"{name}: energy differs between ranks"
    for _, refusal in per_rank:
        assert refusal is not None and "aten::sort" in refusal and "Fix:" in refusal, refusal


# the zoo under aten + sharded (the full table: docs/idiom_zoo.md): the models whose
# sharded form needed the request-table rules, the refusals that guard them, controls
ZOO_EXPECTED = {
    "SchNetLike": "exact", "PaiNNLike": "exact", "ElementMeans": "exact", "UniqueSpeciesMeans": "exact",
    "GCNDegreeNorm": "exact", "PerSystemMeanByBincount": "exact", "GATGlobalShift": "exact",
    "EdgeVectorForces": "exact", "NormalizeOverAtoms": "exact",
    "Covariance": "refused", "AverageNeighbourCount": "refused", "HalfListPairs": "refused",
    "SelfLoops": "refused", "QEqIndexPut": "refused", "DimeNetTriplets": "refused",
}


def _zoo_case(rank, world_size, case):
    from mlipdd.testing.conformance import distributed_outputs

    model, system = case
    options = {**SHARDED, "skin": 0.0}
    out = distributed_outputs(rank, world_size, ZOO[model], SYSTEMS[system](), options, True, SPEC_MPNN_SHARDED)
    return {k: out[k] for k in ("atom_ids", "energy", "forces", "stress")}


@pytest.mark.mlipdd_conformance(world_sizes=(2,))
def test_zoo_selection_exact_or_refused_sharded(world_size):
    outcomes = selection_outcomes(_zoo_case, world_size, ZOO_EXPECTED)
    got = {model: outcome for model, (outcome, _) in outcomes.items()}
    assert got == ZOO_EXPECTED, {m: outcomes[m] for m in ZOO_EXPECTED if got[m] != ZOO_EXPECTED[m]}
