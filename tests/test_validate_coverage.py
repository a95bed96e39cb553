"""Validation's default sample is big enough, and split so, that a wrong model cannot pass.

A model that reads ghost rows it should not, or misses edges and triplets of ghost atoms,
still gets the right answer when every rank's owned atoms plus ghosts cover the whole
system. The wrong models below are ordinary single-process code, each with one such
idiom; the right ones are the LJ reference and the ordinary models of the testing kit.
Another change may make the dispatch refuse some wrong models: a test accepts "refused
with an error" or "reported as failed", never "passed".
"""

from __future__ import annotations

import functools

import pytest
import torch
from mlipdd.cli import main
from mlipdd.data import Batch
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.models.lj import LennardJones
from mlipdd.strategy.grid import choose_grid
from mlipdd.testing.graph_building_model import GraphBuildingMPNN
from mlipdd.testing.ordinary_models import ChargeMPNN, DegreeMPNN, VectorMPNN, WholeSystemMPNN
from mlipdd.testing.systems import triclinic
from mlipdd.testing.toy_models import ToyMPNN, cosine_envelope
from mlipdd.validate import RankView, default_sample, trace_and_validate
from mlipdd.validate.coverage import coverage_warning, default_samples, sighted, unseen_width
from torch import nn

SPECIES = (1, 8, 18)


class _PlainMPNN(ModelWrapper):
    """What every wrong model below shares: species embedding, radial basis, edges."""

    def __init__(self, cutoff: float = 4.0, features: int = 8, n_basis: int = 6, seed: int = 0,
                 dtype=torch.float64):
        super().__init__()
        self.model_config = ModelConfig(NeighborConfig(cutoff), extra={"atomic_numbers": SPECIES})
        g = torch.Generator().manual_seed(seed)
        self.features = features
        table = torch.full((119,), -1, dtype=torch.long)
        table[torch.tensor(SPECIES)] = torch.arange(len(SPECIES))
        self.register_buffer("species_index", table)
        self.register_buffer("centers", torch.linspace(0.5, cutoff, n_basis, dtype=dtype))

        def weight(*shape, scale=None):
            scale = 1.0 / shape[0] if scale is None else scale
            return nn.Parameter(torch.randn(*shape, generator=g, dtype=dtype) * scale)

        self.embed = weight(len(SPECIES), features, scale=0.5)
        self.radial = nn.ParameterList([weight(n_basis, features) for _ in range(2)])
        self.update = nn.ParameterList([weight(features, features) for _ in range(2)])
        self.readout = weight(features)

    def edges(self, batch: Batch, positions, cell):
        sender, receiver = batch.neighbors.edge_index
        vectors = positions[receiver] + batch.neighbors.shifts(cell, batch.batch) - positions[sender]
        d = vectors.norm(dim=1)
        envelope = cosine_envelope(d, self.cutoff)
        basis = torch.exp(-2.0 * (d.unsqueeze(1) - self.centers) ** 2) * envelope.unsqueeze(1)
        return sender, receiver, vectors, d, envelope, basis

    def embedding(self, batch: Batch):
        return self.embed[self.species_index[batch.atomic_numbers]]


class DenseNeighbourMatrix(_PlainMPNN):
    """AIMNet/TorchANI style: edges sorted by receiver, a per-atom bincount and cumsum give
    each edge a slot in an n_atoms x max_neighbours table of senders, and each layer reads
    the node features through that table."""

    def atomic_energies(self, batch, positions, cell):
        sender, receiver, _, _, _, basis = self.edges(batch, positions, cell)
        n_atoms = positions.shape[0]
        order = torch.argsort(receiver, stable=True)
        sender, receiver, basis = sender[order], receiver[order], basis[order]
        counts = torch.bincount(receiver, minlength=n_atoms)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(receiver.shape[0]) - starts[receiver]
        width = int(counts.max()) if counts.numel() else 0
        table = torch.full((n_atoms, width), n_atoms, dtype=torch.long)  # padding: a zero row
        table[receiver, slot] = sender
        h = self.embedding(batch)
        for radial, update in zip(self.radial, self.update):
            weights = torch.zeros(n_atoms, width, self.features, dtype=h.dtype)
            weights[receiver, slot] = basis @ radial
            padded = torch.cat([h, h.new_zeros(1, self.features)])
            messages = (padded[table] * weights).sum(1)
            h = h + torch.tanh(messages @ update)
        return h @ self.readout


class SenderTriplets(_PlainMPNN):
    """DimeNet-style three-body term: pairs of edges that share their SENDER (the angle at
    the sender), built by sorting the edges by sender, each pair's energy going to the
    first edge's receiver."""

    def atomic_energies(self, batch, positions, cell):
        sender, receiver, vectors, d, envelope, basis = self.edges(batch, positions, cell)
        h = self.embedding(batch)
        messages = (basis @ self.radial[0]) * h[sender]
        h = h + torch.tanh(torch.zeros_like(h).index_add(0, receiver, messages) @ self.update[0])
        n_edges = sender.shape[0]
        order = torch.argsort(sender, stable=True)
        counts = torch.bincount(sender, minlength=positions.shape[0])
        starts = torch.cumsum(counts, 0) - counts
        per_edge = counts[sender[order]]
        first = torch.repeat_interleave(torch.arange(n_edges), per_edge)
        group_start = torch.repeat_interleave(torch.cumsum(per_edge, 0) - per_edge, per_edge)
        second = starts[sender[order]][first] + torch.arange(first.shape[0]) - group_start
        e1, e2 = order[first], order[second]
        keep = e1 != e2
        e1, e2 = e1[keep], e2[keep]
        cosine = (vectors[e1] * vectors[e2]).sum(1) / (d[e1] * d[e2])
        angular = (1.0 + cosine) ** 2 * envelope[e1] * envelope[e2] * (h[sender[e1]] @ self.readout)
        three_body = torch.zeros(positions.shape[0], dtype=h.dtype).index_add(0, receiver[e1], angular)
        return h @ self.readout + 0.1 * three_body


class FlattenedMean(_PlainMPNN):
    """Features centred on their mean over every atom and channel, ``x.flatten().mean()``."""

    def atomic_energies(self, batch, positions, cell):
        sender, receiver, _, _, _, basis = self.edges(batch, positions, cell)
        h = self.embedding(batch)
        for radial, update in zip(self.radial, self.update):
            messages = (basis @ radial) * h[sender]
            h = h + torch.tanh(torch.zeros_like(h).index_add(0, receiver, messages) @ update)
            h = h - h.flatten().mean()
        return h @ self.readout


class SelfLoops(_PlainMPNN):
    """GCN-style self-loops: ``torch.arange(positions.shape[0])`` appended to the edges."""

    def atomic_energies(self, batch, positions, cell):
        sender, receiver, _, _, _, basis = self.edges(batch, positions, cell)
        loops = torch.arange(positions.shape[0])
        sender, receiver = torch.cat([sender, loops]), torch.cat([receiver, loops])
        basis = torch.cat([basis, basis.new_ones(loops.shape[0], basis.shape[1])])
        h = self.embedding(batch)
        for radial, update in zip(self.radial, self.update):
            messages = (basis @ radial) * h[sender]
            h = h + torch.tanh(torch.zeros_like(h).index_add(0, receiver, messages) @ update)
        return h @ self.readout


class FlattenedMax(_PlainMPNN):
    """Features scaled by their largest entry over the whole system, ``x.reshape(-1).max()``:
    any rank that sees the atom holding the maximum gets it right."""

    def atomic_energies(self, batch, positions, cell):
        sender, receiver, _, _, _, basis = self.edges(batch, positions, cell)
        h = self.embedding(batch)
        for radial, update in zip(self.radial, self.update):
            messages = (basis @ radial) * h[sender]
            h = h + torch.tanh(torch.zeros_like(h).index_add(0, receiver, messages) @ update)
        return h @ self.readout + 0.2 * h.reshape(-1).abs().max()


class GhostEdgeDegree(_PlainMPNN):
    """An out-degree counted with ``torch.bincount(sender)``: under halo storage a ghost
    atom's edges to atoms of other ranks are not in this rank's list."""

    def atomic_energies(self, batch, positions, cell):
        sender, receiver, _, d, _, basis = self.edges(batch, positions, cell)
        degree = torch.bincount(sender[d < self.cutoff], minlength=positions.shape[0]).clamp(min=1)
        h = self.embedding(batch)
        for radial, update in zip(self.radial, self.update):
            messages = (basis @ radial) * h[sender] / degree[sender].unsqueeze(1)
            h = h + torch.tanh(torch.zeros_like(h).index_add(0, receiver, messages) @ update)
        return h @ self.readout


class PerElementMax(_PlainMPNN):
    """Features scaled per element by the largest one of that element in the system:
    ``scatter_reduce(..., "amax")`` into a table with one row per element."""

    def atomic_energies(self, batch, positions, cell):
        sender, receiver, _, _, _, basis = self.edges(batch, positions, cell)
        element = self.species_index[batch.atomic_numbers]
        h = self.embedding(batch)
        for radial, update in zip(self.radial, self.update):
            messages = (basis @ radial) * h[sender]
            h = h + torch.tanh(torch.zeros_like(h).index_add(0, receiver, messages) @ update)
        slots = element.unsqueeze(1).expand(-1, self.features)
        largest = h.new_zeros(len(SPECIES), self.features).scatter_reduce(0, slots, h.abs(), "amax",
                                                                         include_self=False)
        return (h / (1.0 + largest[element])) @ self.readout


class SortedTop(_PlainMPNN):
    """A readout of the system's largest atomic energies, found by sorting them all."""

    def atomic_energies(self, batch, positions, cell):
        sender, receiver, _, _, _, basis = self.edges(batch, positions, cell)
        h = self.embedding(batch)
        for radial, update in zip(self.radial, self.update):
            messages = (basis @ radial) * h[sender]
            h = h + torch.tanh(torch.zeros_like(h).index_add(0, receiver, messages) @ update)
        energies = h @ self.readout
        ranked = torch.sort(energies.reshape(1, -1), dim=1, descending=True).values
        return energies + 0.1 * ranked[0, 0]


WRONG_MODELS = {
    "dense_neighbour_matrix": DenseNeighbourMatrix,
    "sender_triplets": SenderTriplets,
    "flattened_mean": FlattenedMean,
    "self_loops": SelfLoops,
    "flattened_max": FlattenedMax,
    "ghost_edge_degree": GhostEdgeDegree,
    "per_element_max": PerElementMax,
    "sorted_top": SortedTop,
}

# the strategies each wrong model is wrong under (self-loops over owned rows are exact
# under sharded storage, which has no ghost rows)
# a mean or max over a flattened per-atom tensor is one over the atoms, which the dispatch
# reduces over ranks: not wrong, they must validate as exact
EXACT_BY_DISPATCH = ("flattened_mean", "flattened_max")
WRONG_UNDER = {name: ("halo", "sharded") for name in WRONG_MODELS if name not in EXACT_BY_DISPATCH} | {
    "self_loops": ("halo",)}
WRONG_CASES = [(name, strategy) for name, strategies in WRONG_UNDER.items() for strategy in strategies]
# NOTE [counts in turn]: validation runs the same code at 2 and 3 ranks (the sample is sized
# for the count: test_default_sample_leaves_every_rank_blind_to_part_of_the_system checks
# that at 2, 3, 4 and 8 without spawning), so each model x strategy case runs at ONE count,
# the counts alternating so that every model, every strategy and both counts are still run.
VALIDATED_COUNTS = (2, 3)

# Models the aten dispatch refuses today (a rule it lacks), with the op its refusal names:
# under aten their validation must fail with that refusal as the diagnosis. A rule that
# lands makes the case pass, which fails the test until the entry leaves the list.
# Empty since a parameter's new_zeros(n) is a replicated ShardTensor (charge_mpnn's accumulator,
# NOTE [aten factories]).
ATEN_REFUSES: dict[str, str] = {}


def refused_by_aten_as_listed(name: str, report) -> bool:
    """Under the aten dispatch, a listed model's validation fails with its refusal (the op and
    the fix); False for any other model."""
    if name not in ATEN_REFUSES:
        return False
    assert not report.ok, f"{name} now passes under aten: remove it from ATEN_REFUSES"
    assert f"the aten dispatch refused `{ATEN_REFUSES[name]}" in report.diagnosis, report.summary()
    assert report.next_action.endswith("then re-validate") and "Fix" not in report.next_action
    return True


def in_turn(cases: list[tuple[str, str]]) -> list[tuple[str, str, int]]:
    """Each (model, strategy) at one rank count; neighbours in the list at different ones,
    and a model's halo and sharded cases at different ones."""
    models = sorted({name for name, _ in cases})
    return [(name, strategy, VALIDATED_COUNTS[(models.index(name) + (strategy == "sharded")) % 2])
            for name, strategy in cases]

RIGHT_MODELS = {
    "lennard_jones": functools.partial(LennardJones, epsilon=0.0104, sigma=3.4, cutoff=7.0),
    "toy_mpnn": functools.partial(ToyMPNN, cutoff=4.5, species=(18,)),
    "vector_mpnn": functools.partial(VectorMPNN, species=(1, 8, 18)),
    "charge_mpnn": functools.partial(ChargeMPNN, species=(1, 8, 18)),
    "whole_system_mpnn": functools.partial(WholeSystemMPNN, species=(1, 8, 18)),
    "degree_mpnn": functools.partial(DegreeMPNN, species=(1, 8, 18)),
}


def _old_default_sample(model):
    """What validation used to default to: 125 atoms, a triclinic cell so small that every
    rank's owned atoms plus ghosts are the whole system."""
    return triclinic(species=(18,), spacing=min(3.7, 0.6 * model.cutoff), reps=5)


# ---- the default sample ---------------------------------------------------------------------


@pytest.mark.parametrize("cutoff", [3.0, 4.0, 7.0])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_default_sample_leaves_every_rank_blind_to_part_of_the_system(cutoff, world_size):
    model = DenseNeighbourMatrix(cutoff=cutoff)
    samples = default_samples(model, world_size)
    width = cutoff + 0.5  # DomainConfig's default skin
    first = samples[0]
    grid = choose_grid(first.cell, world_size, width)
    seen = sighted(first, grid, width)
    assert bool((seen.sum(dim=1) < first.num_atoms).all()), "some rank sees every atom"
    assert unseen_width(first.cell, grid.dims, width)[0] >= cutoff
    hidden = torch.zeros(first.num_atoms, dtype=torch.bool)
    for sample in samples:
        hidden |= ~sighted(sample, grid, width).all(dim=0)
    assert bool(hidden.all()), "an atom every rank sees in every position"
    # two species, a triclinic cell, atoms off their grid
    assert sorted(set(first.atomic_numbers.tolist())) == [1, 8]
    cell = first.cell[0]
    cosines = [float(cell[i] @ cell[j] / (cell[i].norm() * cell[j].norm())) for i, j in ((0, 1), (0, 2), (1, 2))]
    assert all(abs(c) > 0.2 for c in cosines)
    # small enough to stay fast: at most a few hundred atoms in at most three positions
    assert first.num_atoms * len(samples) <= 800 and len(samples) <= 3
    assert all(torch.equal(s.atomic_numbers, first.atomic_numbers) for s in samples)


def test_default_sample_of_a_model_without_declared_species_is_argon():
    model = RIGHT_MODELS["lennard_jones"]()
    sample = default_sample(model, 2)
    assert set(sample.atomic_numbers.tolist()) == {18}
    assert sample.num_atoms > 125  # the old default, on which every rank saw every atom


def test_coverage_warning_names_the_ranks():
    views = [RankView(0, owned=60, seen=125, total=125), RankView(1, owned=65, seen=120, total=125)]
    assert coverage_warning(views).startswith("sample too small: rank 0 sees every atom; a wrong model can pass")
    assert coverage_warning([RankView(r, 60, 100, 125) for r in range(2)]) is None
    whole = [RankView(r, owned=62 + r, seen=125, total=125, holds_all=True) for r in range(2)]
    assert coverage_warning(whole) is None  # graph partition sees all by design
    assert "owns every atom" in coverage_warning([RankView(0, 125, 125, 125, True), RankView(1, 0, 125, 125, True)])


# ---- wrong models: passed on the old default, never pass now -------------------------------


def _refused_or_failed(report) -> bool:
    return not report.ok


# right on every rank whenever every rank sees every atom: these passed validation on the
# old default sample under halo storage (at 2 and 3 ranks)
PASSED_ON_SMALL_CELLS = ("flattened_max", "per_element_max", "sorted_top")


@pytest.mark.parametrize("name", PASSED_ON_SMALL_CELLS)
def test_a_wrong_model_on_a_too_small_sample_is_not_passed_as_exact(name):
    factory = functools.partial(WRONG_MODELS[name], cutoff=4.0)
    report = trace_and_validate(factory, _old_default_sample(factory()), world_size=2)
    if report.ok:  # the dispatch let it through: the report must say it proves nothing
        assert not report.conclusive
        assert report.warnings and report.warnings[0].startswith("sample too small: rank")
        assert "a wrong model can pass" in report.summary()
        assert report.summary().splitlines()[0].endswith("not conclusive, see the warning")
        assert "sample was too small" in report.next_action
    covering = [v for views in report.coverage for v in views if v.seen == v.total]
    assert covering or report.last.error, report.summary()


@pytest.mark.parametrize("strategy", ["halo", "sharded"])
@pytest.mark.parametrize("name", EXACT_BY_DISPATCH)
def test_an_idiom_the_dispatch_reduces_over_ranks_validates_as_exact(name, strategy):
    factory = functools.partial(WRONG_MODELS[name], cutoff=4.0)
    report = trace_and_validate(factory, world_size=2, strategy=strategy, max_attempts=1)
    if refused_by_aten_as_listed(name, report):
        return
    assert report.ok and report.conclusive, report.summary()


@pytest.mark.parametrize(("name", "strategy", "world_size"), in_turn(WRONG_CASES))
def test_wrong_models_never_pass_on_the_default_sample(name, strategy, world_size):
    factory = functools.partial(WRONG_MODELS[name], cutoff=4.0)
    report = trace_and_validate(factory, world_size=world_size, strategy=strategy, max_attempts=2)
    if report.ok:  # a dispatch with an exact rule for the idiom: then it must be exact elsewhere too
        assert report.conclusive, report.summary()
        _assert_exact_on_another_sample(factory, world_size, strategy)
        return
    assert _refused_or_failed(report), report.summary()
    assert report.diagnosis and report.next_action
    last = report.last
    if last is not None and not last.error:  # wrong numbers: the diagnosis names the op
        assert report.conclusive, report.summary()
        assert last.unruled_suspects, report.summary()
        named = [op.partition(" (")[0].removeprefix("torch.") for op in last.unruled_suspects]
        assert any(op in report.diagnosis for op in named), report.summary()


def _assert_exact_on_another_sample(factory, world_size, strategy):
    """Passing validation means exact: the same model on a cell of other positions (another
    rattle of the default cell), against one process at 1e-10."""
    from mlipdd.testing.conformance import check_conformance

    batch = default_sample(factory(), world_size, seed=11)
    result = check_conformance(factory, batch, world_size, config_kwargs={"strategy": strategy})
    result.assert_close(energy=1e-10, forces=1e-10, stress=1e-10)


# ---- right models pass, conclusively --------------------------------------------------------


@pytest.mark.parametrize(("name", "strategy", "world_size"),
                         in_turn([(name, strategy) for name in sorted(RIGHT_MODELS) for strategy in ("halo", "sharded")]))
def test_right_models_pass_conclusively_on_the_default_sample(name, strategy, world_size):
    report = trace_and_validate(RIGHT_MODELS[name], world_size=world_size, strategy=strategy)
    if refused_by_aten_as_listed(name, report):
        return
    assert report.ok, report.summary()
    assert report.conclusive and report.warnings == []
    assert len(report.coverage[0]) == world_size
    for views in report.coverage:
        for view in views:
            assert view.owned < view.seen < view.total, report.summary()
    assert "coverage" in report.summary() and "sees" in report.summary()


def test_graph_partition_checks_that_each_rank_owns_a_strict_part():
    factory = functools.partial(GraphBuildingMPNN, cutoff=4.5, layers=2, species=(18,))
    report = trace_and_validate(factory, world_size=2, strategy="graph_partition")
    assert report.ok and report.conclusive, report.summary()
    views = report.coverage[0]
    assert all(v.holds_all and 0 < v.owned < v.total for v in views)
    assert sum(v.owned for v in views) == views[0].total
    assert "sees all by design" in report.summary()


def test_cli_default_sample_is_conclusive_and_a_small_cell_is_flagged(capsys):
    lj = ["validate", "lj", "--model-arg", "epsilon=0.0104", "--model-arg", "sigma=3.4"]
    assert main(lj) == 0
    out = capsys.readouterr().out
    assert "coverage" in out and "rank 0 sees" in out and "WARNING" not in out, out
    assert main([*lj, "--system", "small_cell"]) == 0  # LJ is right, but the cell proves little
    out = capsys.readouterr().out
    assert "WARNING: sample too small: rank" in out and "a wrong model can pass" in out, out


def test_every_count_and_strategy_is_validated_for_wrong_and_right_models():
    """NOTE [counts in turn]: taking counts in turn must not drop a count or a strategy."""
    for cases in (in_turn(WRONG_CASES), in_turn([(n, s) for n in RIGHT_MODELS for s in ("halo", "sharded")])):
        for strategy in ("halo", "sharded"):
            assert {n for _, s, n in cases if s == strategy} == set(VALIDATED_COUNTS), (strategy, cases)
