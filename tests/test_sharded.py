"""Sharded storage equals one process: a charge-equilibration model, 1-4 real gloo ranks, float64."""

import pytest
import torch
from mlipdd.data import AtomicData, Batch, InputError
from mlipdd.distributed import DistributedModel, DomainConfig, StrategyKind
from mlipdd.spec.presets import SPEC_LOCAL
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import check_conformance, gather_by_id, relative_difference
from mlipdd.testing.qeq_model import QEqModel
from mlipdd.testing.systems import small_cell, triclinic, two_systems
from mlipdd.testing.toy_models import ToyMPNN

SPECIES = (1, 8)


def qeq():
    return QEqModel(cutoff=4.5, species=SPECIES)


def neutral_triclinic():
    return triclinic(species=SPECIES, spacing=3.0)


def charged_pair():
    """Two systems (triclinic and cubic) with total charges +1 and -2."""
    batch = two_systems(species=SPECIES, spacing=3.0)
    batch.system["charge"] = torch.tensor([1.0, -2.0], dtype=torch.float64)
    return batch


def own_images():
    """A cell so small that every rank sees periodic images of its own atoms."""
    batch = small_cell(species=SPECIES, spacing=3.0)
    batch.system["charge"] = torch.tensor([0.5], dtype=torch.float64)
    return batch


SYSTEMS = {"triclinic": neutral_triclinic, "two_charged_systems": charged_pair, "own_images": own_images}


def _qeq_worker(rank, world_size, batch, moves=()):
    """One forward (then one per displacement in ``moves``); owned results by atom id."""
    model = qeq()
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.4, strategy=StrategyKind.SHARDED))
    owned = dm.partition(batch if rank == 0 else None)
    steps = []
    for move in (None, *moves):
        if move is not None:
            owned.node["positions"] = owned.positions + move[owned.atom_ids]
        out = dm(owned, compute_stress=True)
        steps.append({"atom_ids": owned.atom_ids.clone(), **{k: out[k] for k in ("energy", "forces", "stress", "charges")}})
    return {
        "steps": steps,
        "rows": dm.strategy.stored_rows(),
        "position_rows": dm.last_padded.positions.shape[0],
        "rebuilds": dm.strategy.rebuilds,
    }


def _reference(batch):
    out = qeq()(batch.clone(), compute_stress=True)
    return {k: v.detach() for k, v in out.items()}


def _assert_matches(steps, reference, n_atoms):
    parts = [dict(s) for s in steps]
    assert relative_difference(parts[0]["energy"], reference["energy"]) <= 1e-12
    assert relative_difference(parts[0]["stress"], reference["stress"]) <= 1e-10
    for key in ("forces", "charges"):
        value = gather_by_id(parts, key, n_atoms)
        assert relative_difference(value, reference[key]) <= 1e-10, key
    for p in parts[1:]:  # replicated outputs agree across ranks
        assert relative_difference(p["energy"], parts[0]["energy"]) < 1e-14


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_sharded_qeq_equals_one_process(system, world_size):
    batch = SYSTEMS[system]()
    results = run_ranks(_qeq_worker, world_size, batch)
    _assert_matches([r["steps"][0] for r in results], _reference(batch), batch.num_atoms)
    for r in results:
        # the model saw owned rows only (its reads of remote rows were routed: exact above)
        assert r["position_rows"] == r["rows"]["owned"]


def test_charges_add_up_to_each_system_total():
    batch = charged_pair()
    results = run_ranks(_qeq_worker, 3, batch)
    charges = gather_by_id([r["steps"][0] for r in results], "charges", batch.num_atoms)
    totals = torch.zeros(2, dtype=torch.float64).index_add(0, batch.batch, charges)
    assert torch.allclose(totals, torch.tensor([1.0, -2.0], dtype=torch.float64), atol=1e-12)


def test_request_plan_kept_until_the_list_is_rebuilt():
    """A move within half the skin reuses the plan; a larger one rebuilds (and may migrate)."""
    batch = neutral_triclinic()
    g = torch.Generator().manual_seed(5)
    small = 0.05 * torch.randn(batch.positions.shape, generator=g, dtype=torch.float64)
    large = 0.6 * torch.randn(batch.positions.shape, generator=g, dtype=torch.float64)
    results = run_ranks(_qeq_worker, 2, batch, (small, large))
    assert all(r["rebuilds"] == 2 for r in results)
    moved = batch.clone()
    for step, move in enumerate((None, small, large)):
        if move is not None:
            moved.node["positions"] = moved.positions + move
        _assert_matches([r["steps"][step] for r in results], _reference(moved), batch.num_atoms)


def _no_grad_worker(rank, world_size, batch):
    """As dynamics calls a model: under no_grad, without stress."""
    model = qeq()
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, strategy=StrategyKind.SHARDED))
    owned = dm.partition(batch if rank == 0 else None)
    with torch.no_grad():
        out = dm(owned)
    return {"atom_ids": owned.atom_ids, "forces": out["forces"]}


def test_forces_under_no_grad_as_dynamics_asks_for_them():
    batch = charged_pair()
    parts = run_ranks(_no_grad_worker, 2, batch)
    forces = gather_by_id(parts, "forces", batch.num_atoms)
    assert relative_difference(forces, _reference(batch)["forces"]) <= 1e-10


def test_sharded_stores_only_owned_rows():
    """Every atom is stored once over all ranks; remote reads need at most the halo's ghosts."""
    batch = neutral_triclinic()
    results = run_ranks(_qeq_worker, 4, batch)
    assert sum(r["position_rows"] for r in results) == batch.num_atoms
    for r in results:
        assert r["rows"]["request_table"] <= r["rows"]["halo_ghosts"]


def mpnn():
    return ToyMPNN(cutoff=4.0, layers=3, species=SPECIES)


@pytest.mark.parametrize("world_size", [2, 3])
def test_halo_style_model_served_by_sharded_storage(world_size):
    """'halo | sharded -> sharded': a plain MPNN's reads are routed to owners."""
    result = check_conformance(mpnn, charged_pair(), world_size, config_kwargs={"strategy": "sharded"})
    result.assert_close()


def test_rank_owning_as_many_atoms_as_systems_equals_one_process():
    """One atom per rank, one system: per-atom and per-system rows have the same count; the
    charge equilibration's per-system scatters are read by their index's placement
    (``batch.batch``), so the run equals one process (it was refused before placements)."""
    cell = torch.eye(3, dtype=torch.float64) * 10.0
    data = AtomicData(positions=[[2.0, 5.0, 5.0], [7.0, 5.0, 5.5]], atomic_numbers=[8, 1], cell=cell, pbc=True)
    result = check_conformance(qeq, Batch.from_data_list([data]), 2,
                               config_kwargs={"strategy": "sharded", "grid": (2, 1, 1)})
    result.assert_close()


def test_two_atoms_and_two_systems_per_rank_equal_one_process_under_aten():
    """The same with two systems under the aten dispatch (one atom of each system per rank)."""
    cell = torch.eye(3, dtype=torch.float64) * 10.0
    data = [AtomicData(positions=[[2.0, 5.0, 5.0], [7.0, 5.0, 5.5 + shift]], atomic_numbers=[8, 1], cell=cell,
                       pbc=True) for shift in (0.0, 0.3)]
    result = check_conformance(qeq, Batch.from_data_list(data), 2,
                               config_kwargs={"strategy": "sharded", "grid": (2, 1, 1)})
    result.assert_close()


def test_local_policy_is_refused_with_the_fix():
    with pytest.raises(InputError, match="does not fit the sharded strategy"):
        DistributedModel(qeq(), DomainConfig(cutoff=4.5, strategy=StrategyKind.SHARDED), spec=SPEC_LOCAL)
