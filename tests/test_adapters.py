"""Method/Python/Jit adapters: install, restore exactly, nest, survive errors."""

from __future__ import annotations

import importlib
import threading

import pytest
import spec_helpers as sh
import torch
from mlipdd.spec import (
    DistributionSpec,
    HaloStoragePolicy,
    JitAdapter,
    MethodAdapter,
    MLIPSpec,
    OpAdapter,
    PythonAdapter,
    SpecError,
    adapter_context,
    installed,
)


def _snapshot(cls):
    return dict(vars(cls))


# ---- MethodAdapter --------------------------------------------------------------------------


def test_class_form_patches_and_restores():
    before = _snapshot(sh.Child)
    original = sh.Child.energy
    adapter = MethodAdapter(sh.Child, "energy", sh.energy_times_100)
    with installed([adapter]):
        assert sh.Child().energy(1) == 1100
        assert sh.Child.energy is not original
    assert sh.Child.energy is original
    assert _snapshot(sh.Child) == before
    assert sh.Child().energy(1) == 11


def test_keyword_form_with_string_replacement_patches_and_restores():
    adapter = MethodAdapter(
        module_path="spec_helpers",
        class_name="Child",
        method_name="energy",
        replacement="spec_helpers:energy_plus_5",
    )
    original = sh.Child.energy
    with installed([adapter]):
        assert sh.Child().energy(1) == 16
    assert sh.Child.energy is original


def test_keyword_and_class_forms_are_equal():
    a = MethodAdapter(sh.Child, "energy", sh.energy_plus_5)
    b = MethodAdapter(
        module_path="spec_helpers",
        class_name="Child",
        method_name="energy",
        replacement="spec_helpers:energy_plus_5",
    )
    assert a == b and hash(a) == hash(b)


def test_install_restore_methods():
    adapter = MethodAdapter(sh.Base, "label", sh.label_patched)
    original = sh.Base.label
    adapter.install()
    try:
        assert adapter.is_installed()
        assert sh.Base().label() == "patched:base"
    finally:
        adapter.restore()
    assert not adapter.is_installed()
    assert sh.Base.label is original
    with pytest.raises(SpecError, match="not installed"):
        adapter.restore()


def test_error_mid_block_leaves_class_exactly_as_before():
    before = _snapshot(sh.Child)
    original = sh.Child.energy
    adapter = MethodAdapter(sh.Child, "energy", sh.raising_energy)
    with pytest.raises(RuntimeError, match="boom"), installed([adapter]):
        sh.Child().energy(1)
    assert sh.Child.energy is original
    assert _snapshot(sh.Child) == before


def test_failed_install_part_way_restores_those_already_installed():
    before = _snapshot(sh.Child)
    good = MethodAdapter(sh.Child, "energy", sh.energy_plus_5)
    bad = MethodAdapter(sh.Child, "no_such_method", sh.energy_plus_5)
    with pytest.raises(SpecError, match="has no method 'no_such_method'"), installed([good, bad]):
        pass  # pragma: no cover
    assert _snapshot(sh.Child) == before


def test_inherited_method_is_restored_by_deleting():
    assert "label" not in vars(sh.Child)
    with installed([MethodAdapter(sh.Child, "label", sh.label_patched)]):
        assert "label" in vars(sh.Child)
        assert sh.Child().label() == "patched:base"
        assert sh.Base().label() == "base"
    assert "label" not in vars(sh.Child)
    assert sh.Child.label is sh.Base.label


def test_inherited_patch_sees_a_later_patch_of_the_base():
    with installed([MethodAdapter(sh.Child, "label", sh.label_patched)]):
        with installed([MethodAdapter(sh.Base, "label", sh.label_patched)]):
            assert sh.Child().label() == "patched:patched:base"
        assert sh.Child().label() == "patched:base"
    assert sh.Child().label() == "base"


def test_nested_adapters_on_one_method_chain_and_restore():
    original = sh.Child.energy
    outer = MethodAdapter(sh.Child, "energy", sh.energy_plus_5)
    inner = MethodAdapter(sh.Child, "energy", sh.energy_times_100)
    with installed([outer]):
        assert sh.Child().energy(1) == 16
        with installed([inner]):
            assert sh.Child().energy(1) == 1600  # inner wraps outer
        assert sh.Child().energy(1) == 16
    assert sh.Child.energy is original


def test_out_of_order_restore_does_not_leak():
    original = sh.Child.energy
    first = MethodAdapter(sh.Child, "energy", sh.energy_plus_5)
    second = MethodAdapter(sh.Child, "energy", sh.energy_times_100)
    first.install()
    second.install()
    first.restore()  # not LIFO: the second patch must stay, on top of the original
    assert sh.Child().energy(1) == 1100
    second.restore()
    assert sh.Child.energy is original


def test_same_adapter_installed_twice_is_reentrant():
    original = sh.Child.energy
    adapter = MethodAdapter(sh.Child, "energy", sh.energy_plus_5)
    with installed([adapter]):
        with installed([adapter]):
            assert sh.Child().energy(1) == 21
        assert sh.Child().energy(1) == 16
    assert sh.Child.energy is original


def test_two_models_in_one_process_do_not_leak():
    """Two specs, interleaved in threads: each sees only its own patch at the end."""
    spec_a = MLIPSpec(
        DistributionSpec(
            HaloStoragePolicy(),
            third_party_helpers=(MethodAdapter(sh.Base, "label", sh.label_patched),),
        )
    )
    spec_b = MLIPSpec(
        DistributionSpec(
            HaloStoragePolicy(),
            third_party_helpers=(MethodAdapter(sh.Child, "energy", sh.energy_plus_5),),
        )
    )
    original_label, original_energy = sh.Base.label, sh.Child.energy
    barrier = threading.Barrier(2)

    def run(spec):
        with installed(spec):
            barrier.wait()
        barrier.wait()

    threads = [threading.Thread(target=run, args=(s,)) for s in (spec_a, spec_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sh.Base.label is original_label and sh.Child.energy is original_energy


def test_replacement_metadata_and_context():
    seen = []

    def energy_with_context(original, self, x):
        seen.append(adapter_context())
        return original(self, x)

    with installed([MethodAdapter(sh.Child, "energy", energy_with_context)], context="ctx-a"):
        assert sh.Child.energy.__name__ == "energy"
        sh.Child().energy(0)
        with installed([], context="ctx-b"):
            sh.Child().energy(0)
        sh.Child().energy(0)
    assert seen == ["ctx-a", "ctx-b", "ctx-a"]
    assert adapter_context() is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"module_path": "spec_helpers", "class_name": "Nope"}, "has no attribute 'Nope'"),
        ({"module_path": "no_such_module_xyz", "class_name": "C"}, "cannot import module"),
    ],
)
def test_keyword_form_bad_targets_fail_on_install(kwargs, match):
    adapter = MethodAdapter(**kwargs, method_name="energy", replacement=sh.energy_plus_5)
    with pytest.raises(SpecError, match=match), installed([adapter]):
        pass  # pragma: no cover


def test_method_adapter_argument_errors():
    with pytest.raises(SpecError, match="missing"):
        MethodAdapter(sh.Child, "energy")
    with pytest.raises(SpecError, match="first argument must be the class"):
        MethodAdapter("spec_helpers.Child", "energy", sh.energy_plus_5)
    with pytest.raises(SpecError, match="callable"):
        MethodAdapter(sh.Child, "energy", 42)


def test_installed_refuses_op_adapters():
    with pytest.raises(SpecError, match="custom_ops"), installed([OpAdapter("mypkg::myop")]):
        pass  # pragma: no cover


# ---- PythonAdapter / JitAdapter -----------------------------------------------------------


def test_python_adapter_swaps_and_restores_module_function():
    original = sh.helper
    adapter = PythonAdapter("spec_helpers", "helper", sh.helper_negated)
    with installed([adapter]):
        assert importlib.import_module("spec_helpers").helper(3) == -3
        assert sh.calls_helper(3) == -3
    assert sh.helper is original
    assert sh.calls_helper(3) == 6


def test_python_adapter_pass_original_delegates():
    adapter = PythonAdapter(
        "spec_helpers", "helper", "spec_helpers:helper_plus_one", pass_original=True
    )
    with installed([adapter]):
        assert sh.helper(3) == 7
    assert sh.helper(3) == 6


def test_python_adapter_restores_after_error():
    before = dict(vars(sh))
    adapter = PythonAdapter("spec_helpers", "helper", sh.helper_negated)
    with pytest.raises(ZeroDivisionError), installed([adapter]):
        raise ZeroDivisionError("mid-block")
    assert dict(vars(sh)) == before


def test_python_adapter_missing_function():
    adapter = PythonAdapter("spec_helpers", "nope", sh.helper_negated)
    with pytest.raises(SpecError, match="has no function 'nope'"), installed([adapter]):
        pass  # pragma: no cover


def test_jit_adapter_swaps_scripted_function():
    original = sh.scripted_helper
    assert isinstance(original, torch.jit.ScriptFunction)
    with installed([JitAdapter("spec_helpers", "scripted_helper", sh.scripted_replacement)]):
        assert sh.scripted_helper(torch.ones(2)).tolist() == [-1.0, -1.0]
    assert sh.scripted_helper is original
    assert sh.scripted_helper(torch.ones(2)).tolist() == [3.0, 3.0]


def test_jit_and_python_adapters_differ():
    a = PythonAdapter("spec_helpers", "helper", sh.helper_negated)
    b = JitAdapter("spec_helpers", "helper", sh.helper_negated)
    assert a != b
