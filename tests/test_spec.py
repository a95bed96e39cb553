"""Spec values: policies and their composition table, transforms, OpAdapter, MLIPSpec."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import spec_helpers as sh
import torch
from mlipdd.data import InputError
from mlipdd.spec import (
    SPEC_LJ_HALO,
    SPEC_LOCAL,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    SPEC_MPNN_SHARDED,
    AllReduceSum,
    DistributionSpec,
    GatherInputs,
    GatherInputsFull,
    GraphPartitionPolicy,
    HaloStoragePolicy,
    LocalPolicy,
    MethodAdapter,
    MLIPSpec,
    OpAdapter,
    OutputKind,
    PythonAdapter,
    ScatterOutputs,
    ShardedStoragePolicy,
    SliceOutputsOwned,
    SliceOwned,
    SpecError,
    merge_policies,
)

HALO, SHARDED, LOCAL, GP = (
    HaloStoragePolicy(),
    ShardedStoragePolicy(),
    LocalPolicy(),
    GraphPartitionPolicy(),
)


def _spec(policy, **kwargs):
    return MLIPSpec(DistributionSpec(policy), **kwargs)


# ---- policies -------------------------------------------------------------------------------


def test_policy_predicates_and_defaults():
    assert HALO.is_halo() and not HALO.is_sharded() and not HALO.builds_own_graph
    assert SHARDED.is_sharded() and LOCAL.is_local()
    assert GP.is_graph_partition() and not GP.is_halo()


def test_policies_are_frozen_and_hashable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        HALO.builds_own_graph = True
    assert len({HALO, HaloStoragePolicy(), SHARDED}) == 2


def test_policy_rejects_a_non_bool_flag():
    with pytest.raises(SpecError, match="builds_own_graph must be True or False"):
        HaloStoragePolicy(builds_own_graph="yes")


# NOTE [composition table tests]: one row of the design's table per case, both orders.
@pytest.mark.parametrize(
    "a, b, expected",
    [
        pytest.param(HALO, HALO, HALO, id="halo|halo->halo"),
        pytest.param(HALO, SHARDED, SHARDED, id="halo|sharded->sharded"),
        pytest.param(SHARDED, SHARDED, SHARDED, id="sharded|sharded->sharded"),
        pytest.param(LOCAL, HALO, HALO, id="local|halo->halo"),
        pytest.param(LOCAL, SHARDED, SHARDED, id="local|sharded->sharded"),
        pytest.param(LOCAL, GP, GP, id="local|gp->gp"),
        pytest.param(LOCAL, LOCAL, LOCAL, id="local|local->local"),
        pytest.param(GP, GP, GP, id="gp|gp->gp"),
    ],
)
def test_composition_table_row(a, b, expected):
    assert merge_policies(a, b) == expected
    assert merge_policies(b, a) == expected
    assert (_spec(a) | _spec(b)).policy == expected


@pytest.mark.parametrize("spatial", [HALO, SHARDED], ids=["halo", "sharded"])
def test_graph_partition_does_not_compose_with_spatial(spatial):
    for a, b in ((GP, spatial), (spatial, GP)):
        with pytest.raises(SpecError, match="cannot share") as info:
            _spec(a) | _spec(b)
        assert "separate distributed models" in str(info.value)
        assert spatial.kind in str(info.value)


@dataclasses.dataclass(frozen=True)
class _TunedSharded(ShardedStoragePolicy):
    """A third party's variant of a built-in kind, with a field of its own."""

    chunk: int = 1


def test_same_kind_with_different_rules_is_a_conflict():
    with pytest.raises(SpecError, match="chunk: 1 vs 2"):
        merge_policies(_TunedSharded(chunk=1), _TunedSharded(chunk=2))


def test_halo_sharded_keeps_the_sharded_operand():
    custom = _TunedSharded(chunk=2)
    assert merge_policies(HaloStoragePolicy(builds_own_graph=True), custom) is custom


def test_merge_rejects_non_policies():
    with pytest.raises(SpecError, match="not a storage policy"):
        merge_policies(HALO, "halo")


# ---- kinds and transforms -------------------------------------------------------------------


def test_output_kind_parse_and_predicates():
    assert OutputKind.parse("PER_NODE") is OutputKind.PER_NODE
    assert OutputKind.parse("per_graph") is OutputKind.PER_GRAPH
    assert OutputKind.GLOBAL.is_global() and OutputKind.UNKNOWN is OutputKind.parse("unknown")
    with pytest.raises(SpecError, match="unknown output kind 'per_atom' for output 'x'"):
        OutputKind.parse("per_atom", output="x")


def test_transform_sides_and_docstrings():
    inputs = (GatherInputs(), GatherInputsFull(), SliceOwned())
    outputs = (ScatterOutputs(), AllReduceSum(), SliceOutputsOwned())
    assert {t.side for t in inputs} == {"input"} and {t.side for t in outputs} == {"output"}
    for t in inputs + outputs:
        assert f"{t.side} transform" in type(t).__doc__.lower()
    assert ScatterOutputs() == ScatterOutputs() and hash(SliceOwned()) == hash(SliceOwned())


# ---- OpAdapter ------------------------------------------------------------------------------


def test_op_adapter_names_are_canonical():
    assert OpAdapter("mypkg::myop").qualified_name == "mypkg::myop"
    assert OpAdapter("mypkg::myop.default") == OpAdapter("mypkg::myop")
    assert OpAdapter("mypkg::myop.out").qualified_name == "mypkg::myop.out"
    assert OpAdapter(torch.ops.aten.relu.default).qualified_name == "aten::relu"
    assert OpAdapter(torch.ops.aten.add.Tensor).qualified_name == "aten::add.Tensor"
    assert OpAdapter(torch.ops.aten.relu) == OpAdapter("aten::relu")
    with pytest.raises(SpecError, match="not a qualified op name"):
        OpAdapter("myop")
    with pytest.raises(SpecError, match="must be a torch op"):
        OpAdapter(42)


def test_op_adapter_resolves_lazily():
    adapter = OpAdapter("aten::relu", output_transforms={0: ScatterOutputs()})
    assert adapter.op == "aten::relu"  # nothing looked up yet
    assert adapter.resolve() is torch.ops.aten.relu.default
    assert OpAdapter("aten::add.Tensor").resolve() is torch.ops.aten.add.Tensor
    assert OpAdapter(torch.ops.aten.relu.default).resolve() is torch.ops.aten.relu.default
    with pytest.raises(SpecError, match="mlipdd_nopkg::nop is not registered"):
        OpAdapter("mlipdd_nopkg::nop").resolve()


def test_op_adapter_transform_checks():
    with pytest.raises(SpecError, match="applies to outputs; move it to output_transforms"):
        OpAdapter("a::b", arg_transforms={0: ScatterOutputs()})
    with pytest.raises(SpecError, match="applies to inputs; move it to arg_transforms"):
        OpAdapter("a::b", output_transforms={0: SliceOwned()})
    with pytest.raises(SpecError, match="note the parentheses"):
        OpAdapter("a::b", output_transforms={0: ScatterOutputs})
    with pytest.raises(SpecError, match="positions"):
        OpAdapter("a::b", output_transforms={"0": ScatterOutputs()})


def test_op_adapter_is_hashable_and_compares_by_content():
    a = OpAdapter("a::b", {1: SliceOwned()}, {0: ScatterOutputs()})
    b = OpAdapter("a::b", {1: SliceOwned()}, {0: ScatterOutputs()})
    assert a == b and hash(a) == hash(b)
    assert a != OpAdapter("a::b", {1: SliceOwned()}, {0: AllReduceSum()})


# ---- DistributionSpec / MLIPSpec ------------------------------------------------------------


def test_distribution_spec_validation():
    with pytest.raises(SpecError, match=r"pass an instance: HaloStoragePolicy\(\)"):
        DistributionSpec(HaloStoragePolicy)
    with pytest.raises(SpecError, match="takes OpAdapter"):
        DistributionSpec(HALO, custom_ops=(MethodAdapter(sh.Child, "energy", sh.energy_plus_5),))
    with pytest.raises(SpecError, match="declares a::b twice"):
        DistributionSpec(HALO, custom_ops=(OpAdapter("a::b"), OpAdapter("a::b", {0: SliceOwned()})))
    # lists become tuples, identical duplicates collapse
    dist = DistributionSpec(HALO, custom_ops=[OpAdapter("a::b"), OpAdapter("a::b")])
    assert dist.custom_ops == (OpAdapter("a::b"),)


def test_mlip_spec_is_frozen_and_hashable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SPEC_MPNN_HALO.name = "x"
    with pytest.raises(TypeError):
        SPEC_MPNN_HALO.output_kinds["energy"] = OutputKind.GLOBAL
    assert hash(SPEC_MPNN_HALO) == hash(SPEC_MPNN_HALO.replace())
    assert SPEC_MPNN_HALO.output_kinds == {
        "energy": OutputKind.PER_GRAPH,
        "forces": OutputKind.PER_NODE,
        "stress": OutputKind.PER_GRAPH,
        "energies": OutputKind.PER_NODE,
    }


def test_mlip_spec_validation():
    with pytest.raises(SpecError, match=r"pass DistributionSpec\(policy=HaloStoragePolicy"):
        MLIPSpec(HALO)
    with pytest.raises(SpecError, match="not 'stress'"):
        _spec(HALO, all_reduce_outputs="stress")
    with pytest.raises(SpecError, match="both owned-only"):
        _spec(HALO, owned_only_outputs={"forces"}, all_reduce_outputs={"forces"})
    with pytest.raises(SpecError, match="owned-only applies to per-atom outputs"):
        _spec(HALO, output_kinds={"energy": "PER_GRAPH"}, owned_only_outputs={"energy"})
    assert _spec(HALO, output_kinds={"e": "per_graph"}).output_kinds["e"] is OutputKind.PER_GRAPH
    assert isinstance(SpecError("x"), InputError)


def test_replace_and_policy_shortcut():
    spec = SPEC_MPNN_HALO.replace(policy=HaloStoragePolicy(builds_own_graph=True), name="fixed")
    assert spec.policy.builds_own_graph and spec.name == "fixed"
    assert spec.output_kinds == SPEC_MPNN_HALO.output_kinds
    assert not SPEC_MPNN_HALO.policy.builds_own_graph
    assert spec.kind_of("nope") is OutputKind.UNKNOWN
    with pytest.raises(SpecError, match="fields are"):
        SPEC_MPNN_HALO.replace(colour="red")


def test_or_merges_everything():
    helper_a = MethodAdapter(sh.Child, "energy", sh.energy_plus_5)
    helper_b = PythonAdapter("spec_helpers", "helper", sh.helper_negated)
    a = MLIPSpec(
        DistributionSpec(HALO, custom_ops=(OpAdapter("a::x"),), third_party_helpers=(helper_a,)),
        output_kinds={"energy": OutputKind.PER_GRAPH, "forces": OutputKind.PER_NODE},
        all_reduce_outputs={"stress"},
        name="mace",
    )
    b = MLIPSpec(
        DistributionSpec(
            HALO,
            custom_ops=(
                OpAdapter("a::x"),
                OpAdapter("a::y", output_transforms={0: ScatterOutputs()}),
            ),
            third_party_helpers=(helper_a, helper_b),
        ),
        output_kinds={"energy": OutputKind.PER_GRAPH, "charges": OutputKind.PER_NODE},
        owned_only_outputs={"charges"},
        name="ewald",
    )
    merged = a | b
    assert merged.name == "mace+ewald"
    assert merged.distribution.custom_ops == (OpAdapter("a::x"), b.distribution.custom_ops[1])
    assert merged.distribution.third_party_helpers == (helper_a, helper_b)
    assert dict(merged.output_kinds) == {
        "energy": OutputKind.PER_GRAPH,
        "forces": OutputKind.PER_NODE,
        "charges": OutputKind.PER_NODE,
    }
    assert merged.owned_only_outputs == {"charges"}
    assert merged.all_reduce_outputs == {"stress"}


def test_or_conflicting_output_kind_names_the_output():
    a = _spec(HALO, output_kinds={"dipole": OutputKind.PER_GRAPH})
    b = _spec(HALO, output_kinds={"dipole": OutputKind.PER_NODE})
    with pytest.raises(SpecError, match="output 'dipole' is PER_GRAPH in one and PER_NODE"):
        a | b


def test_or_conflicting_adapters_for_one_target():
    a = _spec(HALO).replace(distribution=DistributionSpec(HALO, custom_ops=(OpAdapter("a::x"),)))
    b = _spec(HALO).replace(
        distribution=DistributionSpec(HALO, custom_ops=(OpAdapter("a::x", {0: SliceOwned()}),))
    )
    with pytest.raises(SpecError, match="declares a::x twice"):
        a | b
    m1 = _spec(HALO).replace(
        distribution=DistributionSpec(
            HALO, third_party_helpers=(MethodAdapter(sh.Child, "energy", sh.energy_plus_5),)
        )
    )
    m2 = _spec(HALO).replace(
        distribution=DistributionSpec(
            HALO, third_party_helpers=(MethodAdapter(sh.Child, "energy", sh.energy_times_100),)
        )
    )
    with pytest.raises(SpecError, match="spec_helpers:Child.energy twice"):
        m1 | m2


def test_or_with_non_spec():
    with pytest.raises(TypeError):
        SPEC_MPNN_HALO | HALO


# ---- presets --------------------------------------------------------------------------------


def test_presets():
    assert SPEC_MPNN_HALO.policy == HaloStoragePolicy()
    assert SPEC_MPNN_HALO.all_reduce_outputs == {"stress"}
    assert SPEC_LJ_HALO.name != SPEC_MPNN_HALO.name
    assert SPEC_LJ_HALO.replace(name=SPEC_MPNN_HALO.name) == SPEC_MPNN_HALO
    assert SPEC_MPNN_SHARDED.policy.is_sharded()
    assert SPEC_MPNN_GP.policy.is_graph_partition()
    assert SPEC_LOCAL.policy.is_local()
    for preset in (SPEC_MPNN_SHARDED, SPEC_MPNN_GP, SPEC_LOCAL):
        assert preset.output_kinds == SPEC_MPNN_HALO.output_kinds


def test_lj_preset_docstring_points_to_mpnn_halo():
    import inspect

    from mlipdd.spec import presets

    source = inspect.getsource(presets)
    doc = source.split("SPEC_LJ_HALO = ", 1)[1].split('"""')[1]
    assert "SPEC_MPNN_HALO is just as correct" in " ".join(doc.split())


# ---- layering -------------------------------------------------------------------------------


def test_spec_layer_imports_no_upper_layers():
    code = (
        "import sys, mlipdd.spec, mlipdd.spec.serialize\n"
        "bad = [m for m in sys.modules if m.split('.')[:2] in "
        "(['mlipdd','models'],['mlipdd','dynamics'],['mlipdd','distributed'],"
        "['mlipdd','shard'],['mlipdd','plugins'],['mlipdd','strategy'],['mlipdd','validate'])]\n"
        "print(bad); assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_specs_pickle_for_spawned_ranks():
    import copy
    import pickle

    spec = SPEC_MPNN_HALO.replace(
        distribution=DistributionSpec(
            HALO,
            custom_ops=(
                OpAdapter(torch.ops.aten.relu.default, {0: GatherInputs()}, {0: ScatterOutputs()}),
            ),
            third_party_helpers=(
                MethodAdapter(sh.Child, "energy", sh.energy_plus_5),
                PythonAdapter("spec_helpers", "helper", "spec_helpers:helper_negated"),
            ),
        )
    )
    for clone in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec)):
        assert clone == spec and hash(clone) == hash(spec)
        assert clone.distribution.custom_ops[0].resolve() is torch.ops.aten.relu.default
