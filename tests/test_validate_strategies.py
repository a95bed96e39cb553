"""trace_and_validate and `mlipdd validate --strategy` under sharded storage and graph
partition: real spawned gloo ranks (2, 3 and 4), the auto-fix loop and the translator.

The halo strategy's validation is tested in test_validate.py.
"""

import functools

import pytest
import torch
from mlipdd.cli import main
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.models.lj import LennardJones
from mlipdd.spec import (
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    SPEC_MPNN_SHARDED,
    GraphPartitionPolicy,
    MLIPSpec,
    ShardedStoragePolicy,
)
from mlipdd.testing.graph_building_model import GraphBuildingMPNN
from mlipdd.testing.qeq_model import QEqModel
from mlipdd.testing.systems import triclinic
from mlipdd.testing.toy_models import ToyMPNN
from mlipdd.validate import trace_and_validate, translate
from mlipdd.validate.translate import Context

qeq = functools.partial(QEqModel, cutoff=4.5, species=(1, 8))
mpnn = functools.partial(ToyMPNN, cutoff=4.5, species=(18,))
graph_building = functools.partial(GraphBuildingMPNN, cutoff=4.5, layers=2, species=(18,))
argon_lj = functools.partial(LennardJones, epsilon=0.0104, sigma=3.4, cutoff=7.0)


def test_sharded_validation_of_charge_equilibration_on_three_ranks():
    batch = triclinic(species=(1, 8), spacing=3.0)
    report = trace_and_validate(qeq, batch, world_size=3, strategy="sharded")
    assert report.ok, report.summary()
    assert report.strategy == "sharded" and report.spec.policy.is_sharded()
    # the run read remote rows through the edge index and summed per system across ranks
    read, summed = "index_select", "-> replicated"
    assert report.handlers_fired[read] > 0, report.summary()
    assert any(rule.endswith(summed) for rule in report.handlers_fired), report.summary()
    assert "on 3 ranks (sharded strategy)" in report.summary()
    assert float(report.reference["forces"].abs().max()) > 1e-3  # a real check, not zeros


def test_graph_partition_validation_and_a_partition_unaware_model():
    report = trace_and_validate(graph_building, strategy="graph_partition")
    assert report.ok, report.summary()
    assert report.spec == SPEC_MPNN_GP and len(report.attempts) == 1

    unaware = trace_and_validate(argon_lj, strategy="graph_partition")
    assert not unaware.ok and unaware.spec is None
    assert "without using the partition helpers" in unaware.diagnosis
    assert "gather_nodes" in unaware.next_action and "strategy='halo'" in unaware.next_action


class IntSizedState(ModelWrapper):
    """Per-atom state sized by ``int(n)`` and read by sender: the row layout is lost, so
    sharded storage cannot route the read (halo storage reads its ghost rows)."""

    def __init__(self):
        super().__init__()
        self.model_config = ModelConfig(NeighborConfig(4.5))
        self.weight = torch.nn.Parameter(torch.tensor(0.3, dtype=torch.float64))

    def atomic_energies(self, batch, positions, cell):
        nl = batch.neighbors
        sender, receiver = nl.edge_index
        d = (positions[receiver] + nl.shifts(cell, batch.batch) - positions[sender]).norm(dim=1)
        pair = torch.exp(-d) * (d < self.cutoff)  # edges in the skin add nothing
        state = torch.full((int(positions.shape[0]),), 0.5, dtype=positions.dtype)
        return self.weight * torch.zeros_like(positions[:, 0]).index_add(0, receiver, state[sender] * pair)


def test_sharded_validation_names_the_creation_site_of_an_uninferred_tensor():
    """Under the aten dispatch ``torch.full(n)`` is a replicated uniform table, exactly read
    (the deleted torch-function dispatch guessed rows from row counts and refused it)."""
    report = trace_and_validate(IntSizedState, strategy="sharded")
    assert report.ok and report.conclusive, report.summary()


SHARDED_WRONG_SPECS = {
    "graph_partition_policy": SPEC_MPNN_GP,  # refused by the strategy
    "stress_not_reduced": SPEC_MPNN_SHARDED.replace(all_reduce_outputs=frozenset()),  # wrong stress
}


@pytest.mark.parametrize("case", sorted(SHARDED_WRONG_SPECS))
def test_auto_fix_under_sharded_storage(case):
    report = trace_and_validate(mpnn, spec=SHARDED_WRONG_SPECS[case], strategy="sharded")
    assert report.ok, report.summary()
    if report.placements_decide and case != "graph_partition_policy":  # NOTE [auto-fix under aten]
        assert len(report.attempts) == 1 and report.spec == SHARDED_WRONG_SPECS[case] and report.conclusive
        return
    assert len(report.attempts) == 2 and not report.attempts[0].ok
    assert report.spec.policy == ShardedStoragePolicy() and report.spec.all_reduce_outputs == {"stress"}
    assert "did not pass" in report.diagnosis


def test_auto_fix_a_halo_spec_under_graph_partition():
    report = trace_and_validate(graph_building, spec=SPEC_MPNN_HALO, strategy="graph_partition")
    assert report.ok, report.summary()
    assert report.fixes_applied[0].startswith("use_the_strategy_policy: policy HaloStoragePolicy")
    assert report.spec.policy == GraphPartitionPolicy()


def test_cli_validate_sharded_on_four_ranks_saves_the_spec(capsys, tmp_path):
    path = tmp_path / "lj_sharded.json"
    code = main(["validate", "lj", "--model-arg", "epsilon=0.0104", "--model-arg", "sigma=3.4",
                 "--strategy", "sharded", "--world-size", "4", "--save", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "on 4 ranks (sharded strategy)" in out
    assert MLIPSpec.load(path).policy == ShardedStoragePolicy()


# ---- no ranks needed -------------------------------------------------------------------------


def test_unknown_strategy_is_reported_before_any_run(capsys):
    report = trace_and_validate(mpnn, strategy="spiral")
    assert not report.ok and report.attempts == []
    assert "unknown strategy 'spiral'" in report.diagnosis and "sharded" in report.diagnosis
    assert "'sharded'" in report.next_action
    assert main(["validate", "lj", "--strategy", "spiral"]) == 1
    assert "unknown strategy 'spiral'" in capsys.readouterr().out


@pytest.mark.parametrize("message, strategy, expected", [
    ("InputError: the spec's policy HaloStoragePolicy does not fit the graph_partition strategy; use",
     "graph_partition", "mlipdd.spec.SPEC_MPNN_GP"),
    ("InputError: the spec's policy GraphPartitionPolicy does not fit the sharded strategy; use",
     "sharded", "mlipdd.spec.SPEC_MPNN_SHARDED"),
    ("IndexError: index 142 is out of bounds for dimension 0 with size 129", "sharded", "zeros_like"),
    ("InputError: the model ran under graph partition without asking for its node partition, so",
     "graph_partition", "keep_owned_receivers"),
])
def test_translator_knows_the_strategy(message, strategy, expected):
    diagnosis, next_action = translate(message, Context(strategy=strategy))
    assert diagnosis and expected in next_action


def test_out_of_bounds_under_halo_is_not_blamed_on_sharded_storage():
    diagnosis, _ = translate("IndexError: index 9 is out of bounds for dimension 0 with size 3",
                             Context(strategy="halo"))
    assert "sharded" not in diagnosis
