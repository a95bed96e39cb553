"""trace_and_validate and `mlipdd validate`: real spawned gloo ranks, small cells.

Model factories travel to the ranks by pickle, so they are module-level callables or
``functools.partial`` of a class.
"""

import functools
import logging

import pytest
import torch
from mlipdd.cli import main
from mlipdd.models.lj import LennardJones
from mlipdd.spec import (
    SPEC_LOCAL,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    HaloStoragePolicy,
    MLIPSpec,
    OpAdapter,
    ScatterOutputs,
)
from mlipdd.testing.toy_models import ToyMPNN
from mlipdd.validate import (
    OpTrace,
    ValidationReport,
    trace_and_validate,
    translate,
)
from mlipdd.validate.autofix import toggle_owned_only_forces
from mlipdd.validate.report import Attempt, OutputDiff

argon_lj = functools.partial(LennardJones, epsilon=0.0104, sigma=3.4, cutoff=7.0)
mpnn = functools.partial(ToyMPNN, cutoff=4.5, species=(18,))

# Every run is on the aten dispatch (the torch-function one is deleted): its rule that completes
# a scatter into atom rows across ranks, and its sums over the atoms (``... -> replicated``).
SCATTER_INTO_ATOM_ROWS = "index_add"


def sums_over_ranks(report) -> int:
    """Per-system sums completed across ranks, by the report's rule firings."""
    return sum(n for rule, n in report.handlers_fired.items() if rule.endswith("-> replicated"))


# ---- the happy path: no hand-written spec -------------------------------------------------


def test_lj_passes_without_a_spec():
    report = trace_and_validate(argon_lj, device="cuda")
    assert report.ok, report.summary()
    assert report.spec == SPEC_MPNN_HALO
    assert len(report.attempts) == 1
    assert set(report.diffs) == {"energy", "forces", "stress"}
    assert sums_over_ranks(report) > 0, report.summary()
    assert "aten rules fired (all ranks): " in report.summary()
    assert report.next_action == "save it: report.spec.save('model_spec.json')"
    # without a GPU the report says so; with one, a single-rank NCCL check runs
    assert any(note.startswith("CUDA") for note in report.notes)


def test_toy_mpnn_passes_and_summary_says_what_ran(caplog, tmp_path):
    report = trace_and_validate(mpnn)
    assert report.ok, report.summary()
    scatter = SCATTER_INTO_ATOM_ROWS
    assert report.handlers_fired[scatter] >= 3  # one per message-passing layer, per rank
    assert report.opaque_ops == []
    assert report.op_counts["index_add_"] > 0  # the op trace saw the model's scatters
    with caplog.at_level(logging.INFO, logger="mlipdd.validate"):
        text = report.log_summary()
    assert "validation PASSED in 1 attempt" in caplog.text
    for part in ("auto-fix applied: none", "forces", f"{scatter}=", "Next: save it"):
        assert part in text
    report.spec.save(tmp_path / "spec.json")
    assert MLIPSpec.load(tmp_path / "spec.json") == report.spec


# ---- errors become a diagnosis and a fix ---------------------------------------------------


def test_a_dropped_rebind_is_exact():
    """``x.index_add_(...)`` with its return dropped: the aten dispatch keeps an in-place op
    in place, so the model is exact."""
    report = trace_and_validate(functools.partial(ToyMPNN, cutoff=4.5, species=(18,), drop_rebind=True))
    assert report.ok and report.conclusive, report.summary()


def test_unknown_element_in_the_reference_run_is_explained():
    oxygen_only = functools.partial(LennardJones, epsilon={8: 0.01}, sigma={8: 3.0}, cutoff=6.0)
    report = trace_and_validate(oxygen_only)  # default sample is argon
    assert not report.ok and report.attempts == []
    assert "elements the model does not support" in report.diagnosis
    assert "sample_batch" in report.next_action


# ---- specs whose fields the aten dispatch does not read run as given ----------------------

UNREAD_SPECS = {
    "local_policy": SPEC_LOCAL,
    "stress_not_reduced": SPEC_MPNN_HALO.replace(all_reduce_outputs=frozenset()),
}


def test_an_energy_listed_for_all_reduce_is_not_summed_twice():
    """A spec listing the energy in all_reduce_outputs once summed it a second time over
    ranks (2x at 2 ranks; the auto-fix dropped the entry). The energy is a rule's
    cross-rank sum, which the output consolidation now recognises and leaves alone."""
    report = trace_and_validate(mpnn, spec=SPEC_MPNN_HALO.replace(all_reduce_outputs={"energy", "stress"}))
    assert report.ok and len(report.attempts) == 1, report.summary()


@pytest.mark.parametrize("case", sorted(UNREAD_SPECS))
def test_a_spec_the_dispatch_does_not_read_runs_as_given(case):
    """The aten dispatch places every tensor itself: a local policy or a stress left out of
    all_reduce_outputs is exact as given, no auto-fix is tried, and the report says why."""
    report = trace_and_validate(mpnn, spec=UNREAD_SPECS[case])
    assert report.ok and report.placements_decide, report.summary()
    assert len(report.attempts) == 1 and report.spec == UNREAD_SPECS[case]
    assert report.conclusive and "are not read" in report.summary()


def test_auto_fix_stops_at_max_attempts():
    """A graph-partition spec under halo storage is refused by the strategy (either
    dispatch); the fix for it is not tried past max_attempts."""
    report = trace_and_validate(mpnn, spec=SPEC_MPNN_GP, max_attempts=1)
    assert not report.ok and len(report.attempts) == 1
    assert any("max_attempts=1; use_the_strategy_policy" in note for note in report.notes), report.notes
    assert report.next_action


# ---- opaque custom ops ----------------------------------------------------------------------


@torch.library.custom_op("mlipdd_validate_test::aggregate", mutates_args=())
def aggregate(messages: torch.Tensor, receiver: torch.Tensor, n_rows: int) -> torch.Tensor:
    """A per-atom accumulation hidden in a custom op (stands in for a Warp/Triton kernel)."""
    return messages.new_zeros(n_rows, messages.shape[1]).index_add(0, receiver, messages)


@aggregate.register_fake
def _(messages, receiver, n_rows):
    return messages.new_empty(n_rows, messages.shape[1])


def _aggregate_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _aggregate_backward(ctx, grad):
    (receiver,) = ctx.saved_tensors
    return grad.index_select(0, receiver), None, None


aggregate.register_autograd(_aggregate_backward, setup_context=_aggregate_context)


class OpaqueMPNN(ToyMPNN):
    """ToyMPNN whose message aggregation runs inside the custom op above."""

    def atomic_energies(self, batch, positions, cell):
        nl = batch.neighbors
        if nl is None:
            from mlipdd.neighbors import build_neighbor_list

            nl = build_neighbor_list(batch, self.cutoff)
        sender, receiver = nl.edge_index
        d = (positions[receiver] + nl.shifts(cell, batch.batch) - positions[sender]).norm(dim=1)
        basis = torch.exp(-2.0 * (d.unsqueeze(1) - self.centers) ** 2)
        basis = basis * torch.cos(0.5 * torch.pi * torch.clamp(d / self.cutoff, max=1.0)).unsqueeze(1) ** 2
        h = self.embed[self.species_index[batch.atomic_numbers]]
        for radial, update in zip(self.radial, self.update):
            agg = torch.ops.mlipdd_validate_test.aggregate(
                (basis @ radial) * h[sender], receiver, h.shape[0])
            h = h + torch.tanh(agg @ update)
        return h @ self.readout


def test_opaque_custom_op_is_named_with_the_op_adapter_fix():
    report = trace_and_validate(functools.partial(OpaqueMPNN, cutoff=4.5, species=(18,)))
    assert report.opaque_ops == ["mlipdd_validate_test::aggregate.default"]
    assert not report.ok
    assert "mlipdd_validate_test::aggregate" in report.diagnosis
    expected = ("OpAdapter(op=torch.ops.mlipdd_validate_test.aggregate.default, "
                "output_transforms={0: ScatterOutputs()})")
    assert expected in report.next_action
    # the advice is well-formed: it builds
    OpAdapter(op=torch.ops.mlipdd_validate_test.aggregate.default, output_transforms={0: ScatterOutputs()})


def test_op_trace_flags_only_non_aten_namespaces():
    with OpTrace() as trace:
        x = torch.ones(3, 2)
        torch.ops.aten.add.Tensor(x, x)
        aggregate(x, torch.tensor([0, 1, 1]), 2)
    assert trace.opaque_ops == ["mlipdd_validate_test::aggregate.default"]
    assert trace.counts["ones"] == 1


# ---- rules and translator, without ranks ---------------------------------------------------


def _report_with(spec, forces, reference_forces, energy_ok=True):
    report = ValidationReport(world_size=2, reference={"forces": reference_forces})
    attempt = Attempt(number=1, spec=spec, change="initial spec", outputs={"forces": forces})
    attempt.diffs = {"energy": OutputDiff(0.0, 0.0, 1e-9, energy_ok),
                     "forces": OutputDiff(1.0, 1.0, 1e-8, False)}
    report.attempts.append(attempt)
    return report


def test_owned_only_forces_toggle():
    reference = torch.randn(10, 3, dtype=torch.float64)
    owned_only = SPEC_MPNN_HALO.replace(owned_only_outputs={"forces"})
    fixed = toggle_owned_only_forces(_report_with(owned_only, reference * 0.5, reference), owned_only)
    assert fixed.owned_only_outputs == frozenset()
    assert toggle_owned_only_forces(_report_with(owned_only, reference, reference, energy_ok=False),
                                    owned_only) is None


@pytest.mark.parametrize("message, expected", [
    ("InputError: Lennard-Jones has no epsilon/sigma for atomic number(s) [18]; add them", "sample_batch"),
    ("InputError: DomainConfig.cutoff must be positive, got 0", "cutoff"),
    ("FloatingPointError: the distributed forces contains NaN/inf.", "positions.shape[0]"),
    ("no result within 60 s (hung or crashed)", "same ops"),
    ("UnknownNameError: unknown model 'nope'; known models: lj.", "mlipdd plugins"),
    ("ValueError: something odd", "fix the error above"),
    (("mlipdd.shard.aten.tensor.AtenRefusal: mlipdd aten dispatch refuses `aten::mean.default` on distributed "
      "rows: `mean` over the row dimension: its gradient needs the rows of every rank. Arguments: "
      "Rows(dim=0, atoms-owned) (192,) from `aten::mv`. Fix: x.sum(dim) / count, with count a sum over the rows."),
     "x.sum(dim) / count, with count a sum over the rows; then re-validate"),
])
def test_translator_patterns(message, expected):
    diagnosis, next_action = translate(message)
    assert diagnosis and expected in next_action


# ---- the command line ----------------------------------------------------------------------


def test_cli_validate_lj_exits_zero_and_saves(capsys, tmp_path):
    path = tmp_path / "lj_spec.json"
    code = main(["validate", "lj", "--model-arg", "epsilon=0.0104", "--model-arg", "sigma=3.4",
                 "--save", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "validation PASSED" in out and "spec written to" in out
    assert MLIPSpec.load(path).policy == HaloStoragePolicy()


def test_cli_validate_ends_with_the_save_flag_not_python(capsys):
    """Issue 24 item 6: the last line was ``report.spec.save('model_spec.json')``."""
    assert main(["validate", "lj", "--model-arg", "epsilon=0.0104", "--model-arg", "sigma=3.4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == ("Next: save the spec: mlipdd validate lj --model-arg epsilon=0.0104 "
                         "--model-arg sigma=3.4 --save model_spec.json")
    assert not any("report.spec" in line for line in lines)


def test_cli_validate_on_a_too_small_sample_says_so_last_in_shell_terms(capsys, tmp_path):
    """A pass on a sample every rank sees whole is not conclusive: the last line says so and
    gives the command without --system (was: 'save the spec', and a warning speaking Python,
    'leave sample_batch out')."""
    path = tmp_path / "spec.json"
    assert main(["validate", "lj", "--model-arg", "epsilon=0.0104", "--model-arg", "sigma=3.4",
                 "--system", "small_cell", "--save", str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("WARNING: sample too small") and "leave --system out" in line for line in lines)
    assert lines[-1] == ("Next: the sample was too small to prove the model exact; validate on the default "
                         "sample, sized to the model's cutoff: mlipdd validate lj --model-arg epsilon=0.0104 "
                         f"--model-arg sigma=3.4 --save {path}")
    assert not any("sample_batch" in line or "report.spec" in line for line in lines)


def test_cli_unknown_model_is_one_line_of_bad_input(capsys):
    assert main(["validate", "no_such_model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no_such_model'" in err and "mlipdd plugins" in err
    assert len(err.strip().splitlines()) == 1


# ---- what the aten dispatch takes on the model's word ------------------------------------------


class DeclaredRunningSum(ToyMPNN):
    """ToyMPNN plus a running sum of the atomic energies over this rank's rows, declared as
    atom rows: exact in one process, wrong across ranks, and no rule can see it (NOTE
    [declared rows])."""

    def atomic_energies(self, batch, positions, cell):
        from mlipdd.shard import as_atom_rows, local

        energies = super().atomic_energies(batch, positions, cell)
        running = torch.cumsum(local(energies), 0)
        return energies + 0.01 * as_atom_rows(running, energies)


def test_a_wrong_declaration_fails_and_is_named():
    report = trace_and_validate(functools.partial(DeclaredRunningSum, cutoff=4.5, species=(18,)))
    assert not report.ok and report.spec is None, report.summary()
    assert report.diagnosis and report.next_action
    # the rank trace names the declaration the dispatch took on trust
    assert report.last.error is None and not report.last.diffs["energy"].ok
    assert "as_atom_rows" in report.diagnosis and "as_atom_rows only for" in report.next_action, report.summary()
    assert "taken on the model's word (all ranks)" in report.summary()


def test_cli_validate_runs_the_aten_dispatch(capsys):
    args = ["validate", "lj", "--model-arg", "epsilon=0.0104", "--model-arg", "sigma=3.4"]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("aten rules fired (all ranks): ") for line in lines)
    assert lines[-1] == ("Next: save the spec: mlipdd validate lj --model-arg epsilon=0.0104 "
                         "--model-arg sigma=3.4 --save model_spec.json")


def test_a_model_that_counts_skin_edges_is_exact_under_aten():
    """GCN degrees by ``bincount(receiver)`` count every edge of the list: the spatial strategies
    hand the model the edges within the cutoff (NOTE [skin edges]), so it validates
    at the default skin 0.5."""
    from mlipdd.testing.idiom_zoo import ZOO

    report = trace_and_validate(ZOO["GCNDegreeNorm"], max_attempts=1)
    assert report.ok, report.summary()
