"""Spec files: round trips, and every way a file can be refused."""

from __future__ import annotations

import json
import sys

import pytest
import spec_helpers as sh
import torch
from mlipdd.spec import (
    PRESETS,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    AllReduceSum,
    DistributionSpec,
    GatherInputs,
    GraphPartitionPolicy,
    HaloStoragePolicy,
    JitAdapter,
    MethodAdapter,
    MLIPSpec,
    OpAdapter,
    PythonAdapter,
    ScatterOutputs,
    ShardedStoragePolicy,
    SliceOutputsOwned,
    SliceOwned,
    SpecError,
    installed,
)
from mlipdd.spec.serialize import allowed_modules

HELPERS = ["spec_helpers"]


def _roundtrip(spec, tmp_path, allow=()):
    path = tmp_path / "spec.json"
    spec.save(path)
    return MLIPSpec.load(path, allow=allow), json.loads(path.read_text())


def _write(tmp_path, data):
    path = tmp_path / "spec.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# ---- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_roundtrip(name, tmp_path):
    loaded, raw = _roundtrip(PRESETS[name], tmp_path)
    assert loaded == PRESETS[name]
    assert raw["format"] == "mlipdd-spec" and raw["version"] == 1
    assert list(loaded.output_kinds) == list(PRESETS[name].output_kinds)


def _registered_presets() -> list[str]:
    from mlipdd.plugins import registry

    return sorted(registry().presets)


@pytest.mark.parametrize("name", _registered_presets())
def test_every_registered_preset_roundtrips(name, tmp_path):
    """Every preset any installed plugin registers saves and loads again with nothing but
    the plugins' own allow-list (before: SPEC_AIMNET2_HALO/SHARDED and SPEC_UMA_HALO named
    modules their plugins did not allow-list)."""
    from mlipdd.plugins import get_preset

    spec = get_preset(name)
    loaded, _ = _roundtrip(spec, tmp_path)
    assert loaded == spec


def test_the_shipped_plugin_presets_are_among_the_registered():
    import importlib.util

    shipped = {
        "mlipdd_aimnet2": {"SPEC_AIMNET2_HALO", "SPEC_AIMNET2_SHARDED"},
        "mlipdd_uma": {"SPEC_UMA_HALO"},
    }
    for plugin, names in shipped.items():
        if importlib.util.find_spec(plugin) is not None:
            assert names <= set(_registered_presets()), plugin


@pytest.mark.parametrize(
    "name",
    [
        n for n in _registered_presets() if n not in PRESETS
    ],  # the core's have no adapters to install
)
def test_every_registered_preset_installs_after_a_roundtrip(name, tmp_path):
    """The loaded adapters resolve under the strict rules (replacements defined where
    they are named, patched classes defined in their module) and restore cleanly."""
    import importlib
    import importlib.util

    from mlipdd.plugins import get_preset

    loaded, _ = _roundtrip(get_preset(name), tmp_path)
    helpers = loaded.distribution.third_party_helpers
    tops = {h.module_path.split(".")[0] for h in helpers}
    missing = sorted(top for top in tops if importlib.util.find_spec(top) is None)
    if missing:
        pytest.skip(f"{name} patches {missing}, which is not installed")

    def targets():
        out = []
        for h in helpers:
            module = importlib.import_module(h.module_path)
            if h.kind == "method":
                out.append(vars(getattr(module, h.class_name))[h.method_name])
            else:
                out.append(vars(module)[h.function_name])
        return out

    before = targets()
    with installed(loaded):
        during = targets()
    assert all(a is not b for a, b in zip(before, during)) and targets() == before


def test_op_adapter_roundtrip(tmp_path):
    spec = MLIPSpec(
        DistributionSpec(
            ShardedStoragePolicy(),
            custom_ops=(
                OpAdapter(torch.ops.aten.relu.default, {0: GatherInputs()}, {0: ScatterOutputs()}),
                OpAdapter(
                    "tutorial::pair_energy",
                    {1: SliceOwned()},
                    {0: AllReduceSum(), 1: SliceOutputsOwned()},
                ),
            ),
        ),
        output_kinds={"energy": "PER_GRAPH", "charges": "PER_NODE"},
        owned_only_outputs={"charges"},
        name="byo",
    )
    loaded, raw = _roundtrip(spec, tmp_path)
    assert loaded == spec
    assert raw["custom_ops"][0]["op"] == "aten::relu"
    assert loaded.distribution.custom_ops[0].resolve() is torch.ops.aten.relu.default


@pytest.mark.parametrize(
    "helper",
    [
        MethodAdapter(sh.Child, "energy", sh.energy_plus_5),
        MethodAdapter(
            module_path="spec_helpers",
            class_name="Base",
            method_name="label",
            replacement="spec_helpers:label_patched",
        ),
        PythonAdapter("spec_helpers", "helper", sh.helper_plus_one, pass_original=True),
        JitAdapter("spec_helpers", "scripted_helper", "spec_helpers.scripted_replacement"),
    ],
    ids=["method-class-form", "method-keyword-form", "python", "jit"],
)
def test_helper_adapter_roundtrip(helper, tmp_path):
    spec = SPEC_MPNN_HALO.replace(
        distribution=DistributionSpec(HaloStoragePolicy(), third_party_helpers=(helper,))
    )
    loaded, raw = _roundtrip(spec, tmp_path, allow=HELPERS)
    assert loaded == spec
    (entry,) = raw["third_party_helpers"]
    assert entry["type"] == helper.kind
    assert entry["replacement"].startswith("spec_helpers:")
    # the loaded adapter installs and restores like the original
    with installed(loaded):
        pass
    assert "label" not in vars(sh.Child) and sh.helper(1) == 2


def test_loaded_method_adapter_patches(tmp_path):
    spec = SPEC_MPNN_HALO.replace(
        distribution=DistributionSpec(
            HaloStoragePolicy(),
            third_party_helpers=(MethodAdapter(sh.Child, "energy", sh.energy_times_100),),
        )
    )
    loaded, _ = _roundtrip(spec, tmp_path, allow=HELPERS)
    with installed(loaded):
        assert sh.Child().energy(1) == 1100
    assert sh.Child().energy(1) == 11


def test_save_is_atomic_and_leaves_no_temporaries(tmp_path):
    SPEC_MPNN_HALO.save(tmp_path / "a.json")
    SPEC_MPNN_HALO.save(tmp_path / "a.json")
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_unsaveable_replacements(tmp_path):
    def local_energy(original, self, x):
        return x

    for replacement in (local_energy, lambda original, self, x: x):
        spec = SPEC_MPNN_HALO.replace(
            distribution=DistributionSpec(
                HaloStoragePolicy(),
                third_party_helpers=(MethodAdapter(sh.Child, "energy", replacement),),
            )
        )
        with pytest.raises(SpecError, match="define it at module level"):
            spec.save(tmp_path / "x.json")

    class Local:
        def f(self):
            return 1

    spec = SPEC_MPNN_HALO.replace(
        distribution=DistributionSpec(
            HaloStoragePolicy(), third_party_helpers=(MethodAdapter(Local, "f", sh.label_patched),)
        )
    )
    with pytest.raises(SpecError, match="class defined inside a function"):
        spec.save(tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


# ---- refusals -------------------------------------------------------------------------------


def _valid():
    return SPEC_MPNN_HALO.to_dict()


def test_retired_policy_rules_load_and_are_ignored(tmp_path):
    """Files written before the aten dispatch hold scatter / gather / system_reductions
    (NOTE [retired policy keys]): they load as the same spec."""
    data = _valid()
    data["policy"].update(scatter="halo_correction", gather="halo_read", system_reductions=True)
    assert MLIPSpec.load(_write(tmp_path, data)) == SPEC_MPNN_HALO


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="no spec file at"):
        MLIPSpec.load(tmp_path / "nope.json")


@pytest.mark.parametrize("text", ["", "{not json", None], ids=["empty", "garbage", "truncated"])
def test_corrupt_file(text, tmp_path):
    if text is None:
        full = json.dumps(_valid())
        text = full[: len(full) // 2]
    with pytest.raises(SpecError, match="corrupt or truncated") as info:
        MLIPSpec.load(_write(tmp_path, text))
    assert "report.spec.save" in str(info.value)
    assert "trace_and_validate" in str(info.value)


def test_not_utf8(tmp_path):
    path = tmp_path / "spec.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SpecError, match="corrupt"):
        MLIPSpec.load(path)


@pytest.mark.parametrize("tag", ["something-else", None])
def test_wrong_format_tag(tag, tmp_path):
    data = _valid()
    data["format"] = tag
    with pytest.raises(SpecError, match="not an mlipdd spec file"):
        MLIPSpec.load(_write(tmp_path, data))
    with pytest.raises(SpecError, match="not an mlipdd spec file"):
        MLIPSpec.load(_write(tmp_path, [1, 2]))


def test_newer_version(tmp_path):
    data = _valid()
    data["version"] = 2
    with pytest.raises(SpecError, match="format version 2, newer than this mlipdd reads") as info:
        MLIPSpec.load(_write(tmp_path, data))
    assert "upgrade mlipdd" in str(info.value)


@pytest.mark.parametrize("version", [0, "1", True])
def test_invalid_version(version, tmp_path):
    data = _valid()
    data["version"] = version
    with pytest.raises(SpecError, match="invalid version"):
        MLIPSpec.load(_write(tmp_path, data))


def _with_op(transform_name):
    data = _valid()
    data["custom_ops"] = [
        {"op": "a::b", "arg_transforms": {}, "output_transforms": {"0": {"type": transform_name}}}
    ]
    return data


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d["policy"].update(kind="spatial"), "unknown policy kind 'spatial'"),
        (lambda d: d["policy"].update(colour="red"), r"policy has unknown key\(s\) \['colour'\]"),
        (
            lambda d: d["output_kinds"].update(energy="PER_ATOM"),
            "unknown output kind 'PER_ATOM' for output 'energy'",
        ),
        (
            lambda d: d.update(_with_op("ScatterEverything")),
            "unknown transform 'ScatterEverything'",
        ),
        (
            lambda d: d.update(_with_op("SliceOwned")),
            "applies to inputs; move it to arg_transforms",
        ),
        (
            lambda d: d["third_party_helpers"].append(
                {"type": "monkey", "module_path": "mlipdd.spec", "replacement": "mlipdd.spec:x"}
            ),
            "unknown adapter type 'monkey'",
        ),
        (lambda d: d.pop("output_kinds"), "lacks the key 'output_kinds'"),
        (lambda d: d.update(extra=1), r"unknown key\(s\) \['extra'\]"),
        (lambda d: d.update(custom_ops={}), "custom_ops is {}, of the wrong type"),
    ],
    ids=[
        "policy",
        "policy-key",
        "kind",
        "transform",
        "transform-side",
        "adapter-type",
        "missing-key",
        "extra-key",
        "wrong-type",
    ],
)
def test_unknown_names_are_refused(mutate, match, tmp_path):
    data = _valid()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(SpecError, match=match) as info:
        MLIPSpec.load(path)
    assert str(path) in str(info.value)


def _python_helper(module_path, function_name, replacement):
    data = _valid()
    data["third_party_helpers"] = [
        {
            "type": "python",
            "module_path": module_path,
            "function_name": function_name,
            "replacement": replacement,
            "pass_original": False,
        }
    ]
    return data


def test_os_system_is_refused(tmp_path):
    for data in (
        _python_helper("os", "system", "mlipdd.spec.presets:PRESETS"),
        _python_helper("mlipdd.spec.presets", "x", "os:system"),
    ):
        with pytest.raises(SpecError, match="names module 'os'") as info:
            MLIPSpec.load(_write(tmp_path, data))
        assert "mlipdd_register_spec_modules" in str(info.value)


@pytest.mark.parametrize("module", ["mlipdd_spec_test_never_imported", "this"])
def test_unlisted_module_is_refused_without_import(module, tmp_path):
    if module in sys.modules:
        pytest.skip(f"{module} was imported by something else")
    data = _valid()
    data["third_party_helpers"] = [
        {
            "type": "method",
            "module_path": module,
            "class_name": "Anything",
            "method_name": "forward",
            "replacement": f"{module}:replacement",
        }
    ]
    with pytest.raises(SpecError, match=f"names module '{module}'.*not allow-listed") as info:
        MLIPSpec.load(_write(tmp_path, data))
    assert f"register('{module}')" in str(info.value)
    assert module not in sys.modules


def test_allow_list_prefix_means_module_or_submodule(tmp_path):
    ok = _python_helper("mlipdd.spec.presets", "helper", "mlipdd.spec.presets:helper")
    assert MLIPSpec.load(_write(tmp_path, ok)).distribution.third_party_helpers
    for module in ("mlipdd.spec_evil", "mlipdd.specx", "mlipdd"):
        bad = _python_helper(module, "helper", "mlipdd.spec:helper")
        with pytest.raises(SpecError, match=f"names module '{module}'"):
            MLIPSpec.load(_write(tmp_path, bad))


def test_spec_modules_come_from_the_plugin_registry(tmp_path, monkeypatch):
    from mlipdd.plugins import hookimpl, register_plugin, reset_registry, unregister_plugin

    class AllowHelpers:
        @hookimpl
        def mlipdd_register_spec_modules(self, register):
            register("spec_helpers")

    monkeypatch.setenv("MLIPDD_DISABLE_PLUGIN_AUTOLOAD", "1")
    spec = SPEC_MPNN_HALO.replace(
        distribution=DistributionSpec(
            HaloStoragePolicy(),
            third_party_helpers=(MethodAdapter(sh.Child, "energy", sh.energy_plus_5),),
        )
    )
    path = tmp_path / "spec.json"
    spec.save(path)
    with pytest.raises(SpecError, match="names module 'spec_helpers'"):
        MLIPSpec.load(path)
    register_plugin(AllowHelpers(), "test-allow-spec-helpers")
    try:
        assert "spec_helpers" in allowed_modules()
        assert MLIPSpec.load(path) == spec
    finally:
        unregister_plugin("test-allow-spec-helpers")
    try:
        assert "spec_helpers" not in allowed_modules()
    finally:
        reset_registry()  # the next user rebuilds the manager with autoload as configured


def test_a_patch_only_module_may_be_patched_but_never_named_as_a_replacement(tmp_path, monkeypatch):
    from mlipdd.plugins import (
        hookimpl,
        register_plugin,
        registry,
        reset_registry,
        unregister_plugin,
    )

    class PatchOnly:
        @hookimpl
        def mlipdd_register_spec_modules(self, register):
            register("spec_helpers", patch_only=True)

    monkeypatch.setenv("MLIPDD_DISABLE_PLUGIN_AUTOLOAD", "1")
    register_plugin(PatchOnly(), "test-patch-only-spec-helpers")
    try:
        reg = registry()
        assert "spec_helpers" in reg.spec_patch_modules
        assert "spec_helpers" not in reg.spec_modules
        patched = _python_helper("spec_helpers", "helper", "mlipdd.spec.presets:helper")
        assert MLIPSpec.load(_write(tmp_path, patched)).distribution.third_party_helpers
        as_replacement = _python_helper("mlipdd.spec.presets", "x", "spec_helpers:helper_negated")
        with pytest.raises(SpecError, match="allow-listed for patching only") as info:
            MLIPSpec.load(_write(tmp_path, as_replacement))
        assert "third_party_helpers[0].replacement" in str(info.value)
        assert MLIPSpec.load(_write(tmp_path, as_replacement), allow=["spec_helpers"])
    finally:
        unregister_plugin("test-patch-only-spec-helpers")
        reset_registry()


def test_patch_only_must_be_a_bool(monkeypatch):
    from mlipdd.plugins import (
        PluginError,
        hookimpl,
        register_plugin,
        registry,
        reset_registry,
        unregister_plugin,
    )

    class Sloppy:
        @hookimpl
        def mlipdd_register_spec_modules(self, register):
            register("spec_helpers", patch_only="yes")

    monkeypatch.setenv("MLIPDD_DISABLE_PLUGIN_AUTOLOAD", "1")
    register_plugin(Sloppy(), "test-sloppy-patch-only")
    try:
        with pytest.raises(PluginError, match="patch_only='yes'"):
            registry()
    finally:
        unregister_plugin("test-sloppy-patch-only")
        reset_registry()


def test_a_spec_file_with_the_old_graph_parallel_kind_loads(tmp_path):
    data = SPEC_MPNN_GP.to_dict()
    assert data["policy"]["kind"] == "graph_partition"
    data["policy"]["kind"] = "graph_parallel"  # written before the rename
    assert MLIPSpec.load(_write(tmp_path, data)).distribution.policy == GraphPartitionPolicy()
