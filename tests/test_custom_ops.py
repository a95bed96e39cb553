"""OpAdapters under domain decomposition: opaque custom ops equal one process, 1-4 real gloo ranks.

* the Warp example (examples/05_byo_warp_kernel.py): one ScatterOutputs adapter makes it
  exact; without it the answer is wrong and trace_and_validate names the op and the fix;
* every transform on tiny pure-torch custom ops (values and forces vs one process);
* the aten dispatch's refusal of a full gather beside this rank's rows.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from mlipdd.data import Batch
from mlipdd.models import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.shard import ExchangePlan
from mlipdd.shard.custom_ops import activated
from mlipdd.spec import SPEC_MPNN_HALO, DistributionSpec, HaloStoragePolicy, MLIPSpec, OpAdapter
from mlipdd.spec.transforms import (
    AllReduceSum,
    GatherInputs,
    GatherInputsFull,
    ScatterOutputs,
    SliceOutputsOwned,
    SliceOwned,
)
from mlipdd.testing.conformance import distributed_outputs, gather_by_id, relative_difference
from mlipdd.testing.spawn import RankFailure, run_ranks
from mlipdd.testing.systems import triclinic, two_systems

WORLD_SIZES = [1, 2, 3, 4]


# ---- the Warp example, loaded from its file (ranks load it the same way) -------------------


def _example():
    name = "mlipdd_example_05_byo_warp_kernel"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "examples" / "05_byo_warp_kernel.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def warp_model():
    return _example().WarpPairModel()


def warp_model_without_adapter():
    return _example().WarpPairModel(with_adapter=False)


# ---- tiny pure-torch custom ops, one per transform pattern ---------------------------------


@torch.library.custom_op("mlipdd_test::atom_map", mutates_args=())
def atom_map(x: torch.Tensor) -> torch.Tensor:
    """Per-atom tanh (needs only the rows it is given)."""
    return torch.tanh(x)


atom_map.register_fake(lambda x: torch.empty_like(x))
atom_map.register_autograd(
    lambda ctx, g: g * (1 - ctx.y**2),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "y", output),
)


@torch.library.custom_op("mlipdd_test::pair_spread", mutates_args=())
def pair_spread(values: torch.Tensor, edge_index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """w * v_s * v_r per edge, added into BOTH ends (partials land in ghost rows)."""
    s, r = edge_index
    m = weights * values[s] * values[r]
    return torch.zeros_like(values).index_add(0, s, m).index_add(0, r, m)


pair_spread.register_fake(lambda values, edge_index, weights: torch.empty_like(values))


def _pair_spread_save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _pair_spread_backward(ctx, g):
    values, edge_index, weights = ctx.saved_tensors
    s, r = edge_index
    both = g[s] + g[r]
    grad_v = torch.zeros_like(values).index_add(0, s, both * weights * values[r])
    grad_v = grad_v.index_add(0, r, both * weights * values[s])
    return grad_v, None, both * values[s] * values[r]


pair_spread.register_autograd(_pair_spread_backward, setup_context=_pair_spread_save)


@torch.library.custom_op("mlipdd_test::segment_sum", mutates_args=())
def segment_sum(values: torch.Tensor, segment: torch.Tensor, n: int) -> torch.Tensor:
    """One sum per system over the rows given (a per-rank partial under DD)."""
    return values.new_zeros(n).index_add(0, segment, values)


segment_sum.register_fake(lambda values, segment, n: values.new_empty(n))
segment_sum.register_autograd(
    lambda ctx, g: (g[ctx.segment], None, None),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "segment", inputs[1]),
)


@torch.library.custom_op("mlipdd_test::system_mix", mutates_args=())
def system_mix(values: torch.Tensor, segment: torch.Tensor, n: int) -> torch.Tensor:
    """v_i * sum_{j in system(i)} v_j^2: every atom reads its whole system."""
    totals = values.new_zeros(n).index_add(0, segment, values * values)
    return values * totals[segment]


system_mix.register_fake(lambda values, segment, n: torch.empty_like(values))


def _system_mix_save(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.n = inputs[2]


def _system_mix_backward(ctx, g):
    values, segment = ctx.saved_tensors
    totals = values.new_zeros(ctx.n).index_add(0, segment, values * values)
    weighted = values.new_zeros(ctx.n).index_add(0, segment, g * values)
    return g * totals[segment] + 2 * values * weighted[segment], None, None


system_mix.register_autograd(_system_mix_backward, setup_context=_system_mix_save)

PROBE_ADAPTERS = {
    "slice_gather_scatter": (
        OpAdapter(op=torch.ops.mlipdd_test.atom_map.default, arg_transforms={0: SliceOwned()}),
        OpAdapter(op="mlipdd_test::pair_spread", arg_transforms={0: GatherInputs()},
                  output_transforms={0: ScatterOutputs()}),
    ),
    "all_reduce": (
        OpAdapter(op=torch.ops.mlipdd_test.segment_sum.default,
                  arg_transforms={0: SliceOwned(), 1: SliceOwned()}, output_transforms={0: AllReduceSum()}),
    ),
    "full": (
        OpAdapter(op=torch.ops.mlipdd_test.system_mix.default,
                  arg_transforms={0: GatherInputsFull(), 1: GatherInputsFull()},
                  output_transforms={0: SliceOutputsOwned()}),
    ),
}


class ProbeModel(ModelWrapper):
    """Smooth per-edge weights and per-atom densities in plain torch (halo dispatch), then
    one of the custom-op patterns; energies depend on positions through all of it."""

    def __init__(self, pattern: str, with_adapters: bool = True):
        super().__init__()
        self.pattern, self.with_adapters = pattern, with_adapters
        self.model_config = ModelConfig(NeighborConfig(5.0))

    def distribution_spec(self, strategy=None):
        ops = PROBE_ADAPTERS[self.pattern] if self.with_adapters else ()
        return SPEC_MPNN_HALO.replace(distribution=DistributionSpec(HaloStoragePolicy(), custom_ops=ops))

    def atomic_energies(self, batch: Batch, positions, cell):
        s, r = batch.neighbors.edge_index
        vec = positions[r] + batch.neighbors.shifts(cell, batch.batch) - positions[s]
        d2 = (vec * vec).sum(1)
        w = torch.exp(-d2 / 8) * torch.clamp(1 - d2 / self.cutoff**2, min=0) ** 2
        h = torch.zeros_like(positions[:, 0]).index_add(0, r, w)  # complete on every row
        if self.pattern == "slice_gather_scatter":
            q = atom_map(h)  # owned rows only under DD
            return pair_spread(q, batch.neighbors.edge_index, w)  # padded, partial -> corrected
        if self.pattern == "all_reduce":
            totals = segment_sum(h * h, batch.batch, batch.num_systems)  # replicated
            return h * torch.tanh(totals / 100)[batch.batch]
        return 0.1 * system_mix(h, batch.batch, batch.num_systems)


def slice_gather_scatter():
    return ProbeModel("slice_gather_scatter")


def all_reduce():
    return ProbeModel("all_reduce")


def full():
    return ProbeModel("full")


def full_without_adapters():
    return ProbeModel("full", with_adapters=False)


# ---- one spawn, several batches ------------------------------------------------------------


def _each_batch(rank, world_size, factory, batches, spec, config):
    return [distributed_outputs(rank, world_size, factory, b, config, True, spec) for b in batches]


def compare_with_one_process(factory, world_size, batches=None, spec=None, config=None) -> list[dict]:
    """Relative differences (energy, forces, stress) per batch, distributed vs one process."""
    batches = batches or [triclinic(reps=4), two_systems()]
    per_rank = run_ranks(_each_batch, world_size, factory, batches, spec, config or {}, timeout=240)
    diffs = []
    for i, batch in enumerate(batches):
        reference = factory()(batch.clone(), compute_stress=True)
        parts = [rank_results[i] for rank_results in per_rank]
        forces = gather_by_id(parts, "forces", batch.num_atoms)
        diffs.append({
            "energy": relative_difference(parts[0]["energy"], reference["energy"].detach()),
            "forces": relative_difference(forces, reference["forces"].detach()),
            "stress": relative_difference(parts[0]["stress"], reference["stress"].detach()),
        })
    return diffs


def assert_exact(diffs):
    for d in diffs:
        assert d["energy"] <= 1e-12 and d["forces"] <= 1e-10 and d["stress"] <= 1e-10, diffs


# ---- the Warp example -----------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_warp_kernel_with_its_adapter_equals_one_process(world_size):
    assert_exact(compare_with_one_process(warp_model, world_size))


def test_warp_kernel_without_adapter_is_refused_with_the_fix():
    # run on each rank's rows alone it would miss the other ranks' pairs (energy off ~1e-2)
    with pytest.raises(RankFailure, match=r"(?s)gaussian_pair_energies.*OpAdapter"):
        compare_with_one_process(warp_model_without_adapter, 2)


def test_validate_names_the_op_and_the_fix():
    from mlipdd.validate import trace_and_validate

    report = trace_and_validate(warp_model_without_adapter, triclinic(reps=4), world_size=2, max_attempts=1)
    assert not report.ok
    assert "mlipdd_examples::gaussian_pair_energies" in report.diagnosis
    assert ("OpAdapter(op=torch.ops.mlipdd_examples.gaussian_pair_energies.default, "
            "output_transforms={0: ScatterOutputs()})") in report.next_action


def test_validate_passes_with_the_adapter_and_its_spec_round_trips(tmp_path):
    from mlipdd.validate import trace_and_validate

    report = trace_and_validate(warp_model, triclinic(reps=4), world_size=2, max_attempts=1)
    assert report.ok, report.summary()
    path = tmp_path / "warp_spec.json"
    report.spec.save(path)
    assert "mlipdd_examples::gaussian_pair_energies" in path.read_text()  # stored by name
    loaded = MLIPSpec.load(path)
    assert loaded == _example().warp_pair_spec().replace(name=loaded.name)
    assert isinstance(loaded.distribution.custom_ops[0].op, str)
    assert_exact(compare_with_one_process(warp_model_without_adapter, 3, spec=loaded))


# ---- each transform ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("factory", [slice_gather_scatter, all_reduce, full],
                         ids=["SliceOwned+GatherInputs+ScatterOutputs", "SliceOwned+AllReduceSum",
                              "GatherInputsFull+SliceOutputsOwned"])
def test_transform_equals_one_process(factory, world_size):
    assert_exact(compare_with_one_process(factory, world_size))


def test_full_gather_beside_this_ranks_rows_is_refused_under_aten():
    from mlipdd.shard.aten import GHOSTED, AtenRefusal, HaloContext, Rows
    from mlipdd.shard.aten import ShardTensor as AtenShardTensor
    from mlipdd.shard.aten.adapters import AdaptedOps

    ctx = HaloContext(plan=ExchangePlan(torch.tensor([0]), (1,), (1,), 3), n_edges=0)  # one ghost: atom 0's image
    values = AtenShardTensor(torch.ones(4, dtype=torch.float64), Rows(0, GHOSTED), ctx, "values")
    segment = AtenShardTensor(torch.zeros(4, dtype=torch.long), Rows(0, GHOSTED, values="systems"), ctx, "batch")
    adapter = OpAdapter(op="mlipdd_test::system_mix", arg_transforms={0: GatherInputsFull()},
                        output_transforms={0: SliceOutputsOwned()})
    with activated([adapter], row_ids=torch.tensor([0, 1, 2, 0])), AdaptedOps(ctx), \
            pytest.raises(AtenRefusal, match=r"system_mix.*GatherInputsFull\(\) on every argument"):
        system_mix(values, segment, 1)


def test_full_gather_without_adapters_is_refused_with_the_fix():
    with pytest.raises(RankFailure, match=r"(?s)mlipdd_test.system_mix.*OpAdapter"):
        compare_with_one_process(full_without_adapters, 2)
