"""DomainConfig(compile=True) for message-passing models at 2-4 ranks under halo and sharded storage.

Each rank compiles its plain ``[owned | ghost]`` rows with a ghost shell as deep as the
model's layers (NOTE [deep ghost shell] in mlipdd.distributed.compiled_halo): no exchange
inside the compiled forward. Compared with the eager distributed run of the same model
(which equals one process: tests/test_halo_conformance.py) on one batch of three awkward
systems (triclinic periodic, a cell smaller than the shell, a slab with vacuum), then
along an MD path with rebuilds and migration. The "aot_eager" backend (dynamo's trace
and AOT autograd's graphs without code generation): the inductor build is paid once in
tests/test_compile.py.
"""

import pytest
import torch
from mlipdd.data import Batch, InputError
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.distributed.compiled_sums import OWNED_ROWS, system_sum
from mlipdd.models.base import ModelWrapper
from mlipdd.models.lj import LennardJones
from mlipdd.testing import run_ranks
from mlipdd.testing.qeq_model import QEqModel
from mlipdd.testing.systems import slab, small_cell, triclinic

KEYS = ("energy", "energies", "forces", "stress")


def awkward_systems(species) -> Batch:
    """Three systems in one batch (one compile covers them): triclinic, a cell smaller than
    a two-layer shell (every rank sees its own images, many times), a slab with vacuum."""
    parts = [triclinic(species, reps=4), small_cell(species), slab(species, reps=(4, 4, 2))]
    return Batch.from_data_list([data for part in parts for data in part.to_data_list()])


def _worst(worst: dict, a: dict, b: dict) -> None:
    for key in KEYS:
        if key in a and a[key].numel():  # a rank may own no atom of a system
            assert b[key].shape == a[key].shape, key
            scale = max(float(a[key].abs().max()), 1e-300)
            worst[key] = max(worst.get(key, 0.0), float((a[key] - b[key]).abs().max()) / scale)


def _models(model, cutoff, skin=0.3, storage="halo"):
    eager = DistributedModel(model, DomainConfig(cutoff=cutoff, skin=skin, strategy=storage))
    compiled = DistributedModel(model, DomainConfig(cutoff=cutoff, skin=skin, strategy=storage, compile=True,
                                                    compile_backend="aot_eager"))
    return eager, compiled


def _md_on_ranks(rank, world_size, steps, storage="halo"):
    """``steps`` MD steps with the stress (velocities ride in the batch, so they migrate
    with their atoms); per rank: worst relative difference, compile stats, rebuilds and
    how many atoms changed owner."""
    from mlipdd.testing.toy_models import ToyMPNN

    torch.set_default_dtype(torch.float64)
    model = ToyMPNN(cutoff=4.5, features=8, layers=2, species=(18, 36))
    eager, compiled = _models(model, 4.5, storage=storage)
    system = awkward_systems((18, 36)) if rank == 0 else None
    owned, mirror = eager.partition(system), compiled.partition(system)
    assert torch.equal(owned.atom_ids, mirror.atom_ids)  # the deeper shell chose the same grid
    worst: dict = {}
    generator = torch.Generator().manual_seed(rank)
    # a common drift carries atoms across the cut planes (migration at every rebuild) in few steps
    drift = torch.tensor([0.3, 0.3, 0.3], dtype=torch.float64)
    owned.node["velocities"] = drift + 0.02 * torch.randn(owned.positions.shape, generator=generator,
                                                          dtype=torch.float64)
    mirror.node["velocities"] = owned.node["velocities"].clone()
    moved, ids = 0, set(owned.atom_ids.tolist())
    for _ in range(steps):
        a, b = eager(owned, compute_stress=True), compiled(mirror, compute_stress=True)  # one compile
        assert torch.equal(owned.atom_ids, mirror.atom_ids)
        _worst(worst, a, b)
        for batch in (owned, mirror):  # both follow the eager forces: the same geometry
            batch.node["velocities"] = batch.node["velocities"] + 0.1 * a["forces"].clamp(-1.0, 1.0)
            batch.node["positions"] = batch.positions + 0.5 * batch.node["velocities"]
        now = set(owned.atom_ids.tolist())
        moved, ids = moved + len(now ^ ids), now
    assert type(compiled.strategy) is type(eager.strategy)  # the checks ran the run's dispatch (aten by default)
    return worst, compiled.compile_stats, eager.strategy.rebuilds, moved


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_compiled_message_passing_on_ranks_equals_eager_through_migration(world_size):
    """A two-layer MPNN: equal to the eager distributed run to 1e-10 (energy, per-atom
    energies, forces, stress) along an MD path whose rebuilds move atoms between ranks;
    one compile, at most two more (caps with headroom)."""
    results = run_ranks(_md_on_ranks, world_size, 12)
    for worst, stats, rebuilds, _ in results:
        assert set(worst) == set(KEYS) and all(value <= 1e-10 for value in worst.values()), worst
        assert rebuilds >= 3 and stats["compiles"] <= 3, (rebuilds, stats)
    assert sum(moved for *_, moved in results) > 0, "no atom migrated: the test lost its point"


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_compiled_sharded_storage_equals_eager_sharded_through_migration(world_size):
    """Sharded storage (owned rows between calls, reads routed eagerly): compiled, the
    strategy's halo plan hands the compiled region plain rows with the deep shell (NOTE
    [sharded, compiled] in mlipdd.distributed.compiled_halo); equal to the eager SHARDED
    run to 1e-10 along an MD path with migration."""
    results = run_ranks(_md_on_ranks, world_size, 12, "sharded")
    for worst, stats, rebuilds, _ in results:
        assert set(worst) == set(KEYS) and all(value <= 1e-10 for value in worst.values()), worst
        assert rebuilds >= 2 and stats["compiles"] <= 3, (rebuilds, stats)
    assert sum(moved for *_, moved in results) > 0, "no atom migrated: the test lost its point"


def _mace_on_ranks(rank, world_size):
    from mlipdd_mace.testing import random_mace
    from mlipdd_mace.wrapper import MACEWrapper

    torch.set_default_dtype(torch.float64)
    model = MACEWrapper(random_mace(elements=(18, 36), r_max=4.0, channels=4, max_ell=1, correlation=1))
    eager, compiled = _models(model, 4.0)
    system = triclinic(species=(18, 36), reps=3) if rank == 0 else None
    owned, mirror = eager.partition(system), compiled.partition(system)
    assert torch.equal(owned.atom_ids, mirror.atom_ids)  # the deeper shell chose the same grid
    worst: dict = {}
    _worst(worst, eager(owned, compute_stress=True), compiled(mirror, compute_stress=True))
    return worst, model.message_passing_layers, compiled.compile_stats


def test_compiled_mace_on_ranks_equals_eager():
    """MACE e3nn (two interaction blocks: a two-cutoff shell) through its compile hook
    (per-atom energies, the core differentiates the owned ones); two ranks only (the
    general machinery runs at 2-4 above; a MACE compile costs tens of seconds)."""
    pytest.importorskip("mace")
    for worst, layers, stats in run_ranks(_mace_on_ranks, 2):
        assert layers == 2 and stats["compiles"] == 1, (layers, stats)
        assert set(worst) == set(KEYS) and all(value <= 1e-10 for value in worst.values()), worst


class _SummingQEq(QEqModel):
    """Charge equilibration (per-system sums between two layers, as AIMNet2's), every
    per-system sum (the energy's too: QEqModel.forward hands it over) through `system_sum`: compiled at several ranks it runs on
    the plain rows, its sums completed over ranks in the graph (NOTE [own forward on rows])."""

    system_sums_over_ranks = True
    message_passing_layers = 2  # layer 2 reads the charges and features that layer 1 made

    def system_sum(self, values, batch):
        return system_sum(values, batch.batch, batch.num_systems, batch.node.get(OWNED_ROWS))


def _summing_on_ranks(rank, world_size, steps):
    torch.set_default_dtype(torch.float64)
    model = _SummingQEq(cutoff=4.5, features=8, species=(18, 36))
    eager, compiled = _models(model, 4.5, storage="sharded")
    system = awkward_systems((18, 36)) if rank == 0 else None
    if system is not None:
        system.system["charge"] = torch.tensor([1.0, -2.0, 0.0])
    owned, mirror = eager.partition(system), compiled.partition(system)
    worst: dict = {}
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        a, b = eager(owned, compute_stress=True), compiled(mirror, compute_stress=True)
        _worst(worst, a, b)
        step = 0.05 * torch.randn(owned.positions.shape, generator=generator)
        for batch in (owned, mirror):
            batch.node["positions"] = batch.positions + step
    charge = torch.zeros(3).index_add(0, mirror.batch, b["charges"])
    torch.distributed.all_reduce(charge)
    return worst, compiled.compile_stats, charge.tolist()


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_compiled_own_forward_sums_over_ranks_equals_eager(world_size):
    """A wrapper with its own forward and per-system sums in the middle (charge equilibration)
    under sharded storage: compiled, its sums run as functional collectives in the graph and
    its derivatives are divided by the rank count (NOTE [replicated seed]); equal to the eager
    sharded run to 1e-10 (energy, forces, stress) over three calls, and the charges add up to
    each system's total on every rank count."""
    for worst, stats, charge in run_ranks(_summing_on_ranks, world_size, 3, timeout=900.0):
        assert {"energy", "forces", "stress"} <= set(worst) and all(v <= 1e-10 for v in worst.values()), worst
        assert stats["compiles"] <= 2 and stats["checks"] >= 1, stats
        assert max(abs(c - t) for c, t in zip(charge, (1.0, -2.0, 0.0))) < 1e-10, charge


class _ForwardOnly(LennardJones):
    """A wrapper with its own forward and no per-atom energies (as UMA's)."""

    atomic_energies = ModelWrapper.atomic_energies  # the base class's: not implemented

    def forward(self, batch, compute_stress=False):
        raise AssertionError("never called: refused before")


class _Undeclared(LennardJones):
    """Its own forward and per-atom energies, but no word on how many hops they read."""

    def forward(self, batch, compute_stress=False):
        return super().forward(batch, compute_stress)


def _refusals_on_ranks(rank, world_size):
    messages = []
    for cls in (_ForwardOnly, _Undeclared):
        try:
            DistributedModel(cls(epsilon=0.0104, sigma=3.4, cutoff=6.0),
                             DomainConfig(cutoff=6.0, compile=True, compile_backend="aot_eager"))
        except InputError as error:
            messages.append(str(error))
    return messages


def test_what_cannot_compile_on_ranks_is_refused_by_name():
    for forward_only, undeclared in run_ranks(_refusals_on_ranks, 2):
        assert "_ForwardOnly" in forward_only and "atomic_energies" in forward_only, forward_only
        assert "ONE rank" in forward_only, forward_only
        assert "_Undeclared" in undeclared and "message_passing_layers" in undeclared, undeclared
