"""Hostile and damaged spec files (catalogue entries S1-S4).

S1: an allow-listed module that re-exports another module's object (``from os import
system``) used to lend it out: a crafted file named ``module:system`` as a replacement,
and installing the spec ran a shell command. Only objects *defined* in the module a file
names, of the declared kind, resolve now. S2: values of the wrong JSON type
(``"pass_original": "false"`` loaded as true; unhashable entries raised a bare
TypeError). S3: a damaged file (bad JSON, wrong top-level type, unknown keys, a bad
version, a directory, absurd nesting) is one line naming the file and the fix.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from mlipdd.spec import SPEC_MPNN_HALO, MLIPSpec, SpecError, installed

MODULE = "mlipdd_fault_spec_reexports"

# An allow-listed module as a plugin might write it: its own functions and class, plus
# names it merely holds (imports), which a spec file must not be able to reach.
_SOURCE = """
import os
from os import system
from argparse import ArgumentParser as Parser
from json import dumps as borrowed


def helper(command):
    return "helper"


def calls_helper(command):
    return helper(command)


def own_replacement(command):
    return "own replacement"


def own_forward(original, self, x):
    return ("own forward", original(self, x))


class Model:
    def forward(self, x):
        return x
"""


@pytest.fixture
def reexports(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(MODULE, None)
    yield __import__(MODULE)
    sys.modules.pop(MODULE, None)


def _with_helpers(tmp_path, *helpers):
    data = SPEC_MPNN_HALO.to_dict()
    data["third_party_helpers"] = list(helpers)
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps(data))
    return path


def _python(function_name, replacement):
    return {
        "type": "python",
        "module_path": MODULE,
        "function_name": function_name,
        "replacement": replacement,
        "pass_original": False,
    }


def _method(class_name, method_name, replacement):
    return {
        "type": "method",
        "module_path": MODULE,
        "class_name": class_name,
        "method_name": method_name,
        "replacement": replacement,
    }


# ---- S1: only what an allow-listed module defines, of the declared kind ----------------------


@pytest.mark.parametrize(
    "replacement",
    [f"{MODULE}:system", f"{MODULE}:os.system"],
    ids=["re-exported-builtin", "through-an-imported-module"],
)
def test_a_reexported_os_system_is_refused_and_nothing_runs(replacement, reexports, tmp_path):
    """The reported case: before, installing the loaded spec swapped ``helper`` for
    ``os.system`` and the model's next call ran the command."""
    marker = tmp_path / "pwned"
    spec = MLIPSpec.load(_with_helpers(tmp_path, _python("helper", replacement)), allow=[MODULE])
    with pytest.raises(SpecError, match="defined at posix:system, not in") as info, installed(spec):
        reexports.calls_helper(f"touch {marker}")
    assert "defined in the module it names" in str(info.value)
    assert not marker.exists()
    assert reexports.calls_helper("x") == "helper"  # nothing stayed patched


@pytest.mark.parametrize(
    "helper, match",
    [
        (_python("helper", f"{MODULE}:borrowed"), "defined at json:dumps, not in"),
        (_method("Model", "forward", f"{MODULE}:system"), "defined at posix:system"),
        (
            _method("Parser", "parse_args", f"{MODULE}:own_replacement"),
            "defined at argparse:ArgumentParser, not in",
        ),
        (_python("helper", f"{MODULE}:Model"), "not a Python function"),
        (_method("helper", "forward", f"{MODULE}:own_replacement"), "not a class"),
        (_python("os", f"{MODULE}:own_replacement"), "not a function"),
        (
            _method("Model", "__init__", f"{MODULE}:own_replacement"),
            "not a method defined in Python",
        ),
    ],
    ids=[
        "python-function-of-another-module",
        "method-replacement-builtin",
        "reexported-class",
        "class-as-replacement",
        "function-as-class",
        "module-as-target",
        "builtin-method",
    ],
)
def test_names_of_the_wrong_origin_or_kind_are_refused(helper, match, reexports, tmp_path):
    import argparse

    before = dict(vars(argparse.ArgumentParser))
    spec = MLIPSpec.load(_with_helpers(tmp_path, helper), allow=[MODULE])
    with pytest.raises(SpecError, match=match), installed(spec):
        pass  # pragma: no cover
    assert dict(vars(argparse.ArgumentParser)) == before
    assert reexports.calls_helper("x") == "helper" and reexports.os is __import__("os")


def test_what_the_module_defines_still_loads_and_installs(reexports, tmp_path):
    spec = MLIPSpec.load(
        _with_helpers(
            tmp_path,
            _python("helper", f"{MODULE}:own_replacement"),
            _method("Model", "forward", f"{MODULE}:own_forward"),
        ),
        allow=[MODULE],
    )
    with installed(spec):
        assert reexports.calls_helper("x") == "own replacement"
        assert reexports.Model().forward(1) == ("own forward", 1)
    assert reexports.calls_helper("x") == "helper" and reexports.Model().forward(1) == 1


# ---- S2: every value's JSON type is checked ---------------------------------------------------


def _valid():
    data = SPEC_MPNN_HALO.to_dict()
    data["custom_ops"] = [
        {"op": "a::b", "arg_transforms": {"0": {"type": "SliceOwned"}}, "output_transforms": {}}
    ]
    data["third_party_helpers"] = [
        {
            "type": "python",
            "module_path": "mlipdd.spec.presets",
            "function_name": "f",
            "replacement": "mlipdd.spec.presets:f",
            "pass_original": False,
        },
        {
            "type": "method",
            "module_path": "mlipdd.spec.presets",
            "class_name": "C",
            "method_name": "m",
            "replacement": "mlipdd.spec.presets:g",
        },
    ]
    return data


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def mutate(data):
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return mutate


@pytest.mark.parametrize(
    "mutate, field, expected",
    [
        (
            _set("third_party_helpers", 0, "pass_original", "false"),
            "third_party_helpers[0].pass_original is 'false'",
            "a JSON boolean",
        ),
        (
            _set("third_party_helpers", 0, "pass_original", 0),
            "third_party_helpers[0].pass_original is 0",
            "a JSON boolean",
        ),
        (
            _set("policy", "system_reductions", "true"),
            "policy.system_reductions is 'true'",
            "a JSON boolean",
        ),
        (_set("policy", "scatter", ["local"]), "policy.scatter is ['local']", "a JSON string"),
        (_set("policy", "kind", ["halo"]), "policy.kind is ['halo']", "a JSON string"),
        (_set("policy", []), "policy is []", "a JSON object"),
        (_set("name", 5), "name is 5", "a JSON string"),
        (_set("custom_ops", 0, "op", 5), "custom_ops[0].op is 5", "a JSON string"),
        (
            _set("custom_ops", 0, "arg_transforms", []),
            "custom_ops[0].arg_transforms is []",
            "a JSON object",
        ),
        (
            _set("custom_ops", 0, "arg_transforms", "0", {"type": ["SliceOwned"]}),
            "custom_ops[0].arg_transforms[0].type is ['SliceOwned']",
            "a JSON string",
        ),
        (
            _set("custom_ops", 0, "arg_transforms", "0", ["SliceOwned"]),
            "custom_ops[0].arg_transforms[0] is ['SliceOwned']",
            "a JSON object",
        ),
        (
            _set("custom_ops", 0, "arg_transforms", {"\u00b2": {"type": "SliceOwned"}}),
            "custom_ops[0].arg_transforms has position '\u00b2'",
            "integers",
        ),
        (_set("output_kinds", "energy", 1), "output_kinds['energy'] is 1", "a JSON string"),
        (
            _set("owned_only_outputs", [["forces"]]),
            "owned_only_outputs[0] is ['forces']",
            "a JSON string",
        ),
        (_set("all_reduce_outputs", "energy"), "all_reduce_outputs is 'energy'", "a JSON array"),
        (
            _set("third_party_helpers", 1, "class_name", {"C": 1}),
            "third_party_helpers[1].class_name is {'C': 1}",
            "a JSON string",
        ),
        (
            _set("third_party_helpers", 1, "type", ["method"]),
            "third_party_helpers[1].type is ['method']",
            "a JSON string",
        ),
        (_set("third_party_helpers", 0, 7), "third_party_helpers[0] is 7", "a JSON object"),
    ],
    ids=[
        "pass-original-string",
        "pass-original-int",
        "policy-bool",
        "policy-rule-list",
        "policy-kind-list",
        "policy-array",
        "name",
        "op",
        "transforms-array",
        "transform-type-list",
        "transform-entry-list",
        "position-superscript",
        "output-kind",
        "owned-only-entry",
        "all-reduce-string",
        "class-name",
        "adapter-type-list",
        "helper-int",
    ],
)
def test_a_value_of_the_wrong_json_type_is_refused(mutate, field, expected, tmp_path):
    data = _valid()
    mutate(data)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError) as info:
        MLIPSpec.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert field in message and expected in message, message
    assert "\n" not in message


def test_pass_original_false_written_as_a_string_never_loads_as_true(tmp_path):
    data = _valid()
    data["third_party_helpers"][0]["pass_original"] = "false"
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match="write true or false, without quotes"):
        MLIPSpec.load(path)
    data["third_party_helpers"][0]["pass_original"] = False
    path.write_text(json.dumps(data))
    assert MLIPSpec.load(path).distribution.third_party_helpers[0].pass_original is False


# ---- S3: a damaged file is one line naming the file and the fix -------------------------------


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"format": "mlipdd-spec", "version": 1,', "corrupt or truncated"),
        ("[1, 2]", "holds a JSON array"),
        ('"mlipdd-spec"', "holds a JSON string"),
        ("[" * 100_000, "corrupt"),
        (
            json.dumps({**SPEC_MPNN_HALO.to_dict(), "colour": "red"}),
            r"unknown key\(s\) \['colour'\]",
        ),
        (json.dumps({**SPEC_MPNN_HALO.to_dict(), "version": "1"}), "invalid version '1'"),
        (json.dumps({**SPEC_MPNN_HALO.to_dict(), "version": 99}), "upgrade mlipdd"),
    ],
    ids=[
        "truncated",
        "array",
        "string",
        "nested",
        "unknown-key",
        "version-string",
        "version-newer",
    ],
)
def test_a_damaged_file_is_one_line_naming_the_file_and_the_fix(content, match, tmp_path):
    path = tmp_path / "damaged.json"
    path.write_text(content)
    with pytest.raises(SpecError, match=match) as info:
        MLIPSpec.load(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert "MLIPSpec.save" in message or "regenerate" in message or "upgrade" in message


def test_a_directory_as_spec_file_is_named(tmp_path):
    with pytest.raises(SpecError, match="cannot read spec file") as info:
        MLIPSpec.load(tmp_path)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)
