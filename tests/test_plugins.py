"""Plugin discovery, registry, wrap_model and `mlipdd plugins`, on real installed dists.

The fixture distributions in tests/fixtures/plugins/ are built and pip-installed
(``--target``) into a private directory that the tests put on ``sys.path`` (and
``PYTHONPATH`` for the CLI subprocess). Discovery then goes through genuine entry
points and dist metadata, while the shared virtual environment is never modified, so
developers running other tests at the same time never see the broken fixture.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import mlipdd
import pytest
import torch
from mlipdd import plugins
from mlipdd.cli import main
from mlipdd.data import AtomicData, Batch
from mlipdd.models.base import ModelWrapper

FIXTURES = Path(__file__).parent / "fixtures" / "plugins"
FIXTURE_MODULES = ("mlipdd_fixture_good", "mlipdd_fixture_broken")
MLIPDD_SCRIPT = Path(sys.executable).parent / "mlipdd"


def pip_install_into(target: Path, work: Path, *fixture_names: str) -> Path:
    """Build fixture dists from a copy and pip-install them into ``target``."""
    sources = []
    for name in fixture_names:
        # Build from a copy: building in place would leave build/ and *.egg-info in tests/.
        shutil.copytree(FIXTURES / name, work / name)
        sources.append(str(work / name))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), *sources],
        check=True,
    )  # fmt: skip
    return target


@pytest.fixture(scope="module")
def fixture_site(tmp_path_factory) -> Path:
    """The good and the broken fixture dists, installed once into a private site dir."""
    work = tmp_path_factory.mktemp("fixture_plugins")
    return pip_install_into(work / "site", work, "good_plugin", "broken_plugin")


@pytest.fixture
def installed_fixtures(fixture_site) -> Path:
    """The fixture dists, visible to this test only; gone (modules too) afterwards."""
    sys.path.insert(0, str(fixture_site))
    yield fixture_site
    sys.path.remove(str(fixture_site))
    for module in [m for m in sys.modules if m.split(".")[0] in FIXTURE_MODULES]:
        del sys.modules[module]
    plugins.reset_registry()


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.delenv(plugins.AUTOLOAD_ENV_VAR, raising=False)
    plugins.reset_registry()
    yield
    plugins.reset_registry()


def load_with_fixtures() -> plugins.Registry:
    """The registry with fixtures installed, expecting the broken one's warning."""
    with pytest.warns(RuntimeWarning, match="fixture_broken"):
        return plugins.registry()


def in_process_plugin(name: str, **hooks) -> types.ModuleType:
    """A plugin module made of the given hook functions (marked as hookimpls)."""
    module = types.ModuleType(name)
    for hook_name, function in hooks.items():
        setattr(module, hook_name, mlipdd.hookimpl(function))
    return module


@pytest.fixture
def registered():
    """Register in-process plugins by name; unregister them after the test."""
    names = []

    def register(name: str, **hooks):
        plugins.register_plugin(in_process_plugin(name, **hooks), name)
        names.append(name)

    yield register
    for name in names:
        plugins.unregister_plugin(name)


def test_hookimpl_is_reexported_for_plugin_authors():
    assert mlipdd.hookimpl is plugins.hookimpl


def test_builtin_plugin_is_always_there():
    reg = plugins.registry()
    assert reg.plugins[0] == ("builtin", "mlipdd", mlipdd.__version__)
    assert reg.models["lj"].plugin == "builtin"
    assert "mlipdd.spec" in reg.spec_modules


def test_get_preset_finds_every_preset_of_the_core():
    """One registry: each MLIPSpec in mlipdd.spec.presets is in PRESETS and get_preset finds it."""
    from mlipdd.spec import MLIPSpec, presets

    module_specs = {name for name in presets.__all__ if isinstance(getattr(presets, name), MLIPSpec)}
    assert module_specs == set(presets.PRESETS), "add the new preset to mlipdd.spec.presets.PRESETS"
    for name in module_specs:
        assert plugins.get_preset(name) is getattr(presets, name)
        assert plugins.registry().preset_plugins[name] == "builtin"


def test_installed_plugin_is_discovered_with_its_version(installed_fixtures):
    reg = load_with_fixtures()
    assert ("fixture_good", "mlipdd-fixture-good", "1.2.3") in reg.plugins
    assert reg.models["fixture_harmonic"].plugin == "fixture_good"
    assert reg.models["fixture_harmonic"].description == "harmonic well (test fixture)"
    assert reg.preset_plugins["SPEC_FIXTURE_GOOD"] == "fixture_good"
    assert "mlipdd_fixture_good.spec" in reg.spec_modules
    assert plugins.get_preset("SPEC_FIXTURE_GOOD").name == "fixture"


def test_model_from_installed_plugin_computes(installed_fixtures):
    load_with_fixtures()
    model = plugins.create_model("fixture_harmonic", stiffness=2.0)
    assert isinstance(model, ModelWrapper)
    positions = torch.tensor([[0.5, 0.0, 0.0], [0.0, -1.0, 2.0]], dtype=torch.float64)
    batch = Batch.from_data_list([AtomicData(positions, [1, 1])])
    out = model(batch)
    torch.testing.assert_close(out["forces"], -2.0 * positions)
    torch.testing.assert_close(out["energy"], torch.tensor([5.25], dtype=torch.float64))


def test_broken_plugin_is_reported_and_skipped_while_others_load(installed_fixtures):
    with pytest.warns(
        RuntimeWarning, match="'fixture_broken'.*mlipdd-fixture-broken.*fails on purpose"
    ):
        reg = plugins.registry()
    (failure,) = [f for f in reg.failed if f.name == "fixture_broken"]
    assert "RuntimeError" in failure.error and "fails on purpose" in failure.error
    names = [p.name for p in reg.plugins]
    assert "fixture_broken" not in names
    assert {"builtin", "fixture_good"} <= set(names)


@pytest.mark.filterwarnings("ignore:.*'fixture_broken':RuntimeWarning")
def test_second_dist_claiming_a_plugin_name_is_reported(installed_fixtures, tmp_path):
    clash_site = pip_install_into(tmp_path / "site", tmp_path, "clash_plugin")
    sys.path.insert(1, str(clash_site))  # after the good plugin's site: discovered second
    try:
        with pytest.warns(RuntimeWarning, match="mlipdd-fixture-clash"):
            reg = plugins.registry()
    finally:
        sys.path.remove(str(clash_site))
    (failure,) = [f for f in reg.failed if f.name == "fixture_good"]
    assert "already taken by mlipdd-fixture-good" in failure.error
    assert ("fixture_good", "mlipdd-fixture-good", "1.2.3") in reg.plugins


def test_env_var_turns_autoload_off_and_keeps_builtin(installed_fixtures, monkeypatch):
    monkeypatch.setenv(plugins.AUTOLOAD_ENV_VAR, "1")
    plugins.reset_registry()
    reg = plugins.registry()  # no warning: the broken plugin is not even imported
    assert [p.name for p in reg.plugins] == ["builtin"]
    assert "lj" in reg.models and "fixture_harmonic" not in reg.models
    assert reg.failed == []


def test_env_var_zero_keeps_autoload_on(monkeypatch):
    monkeypatch.setenv(plugins.AUTOLOAD_ENV_VAR, "0")
    assert not plugins.autoload_disabled()


def test_a_plugin_shadowing_a_core_model_is_disabled_and_the_core_keeps_it(registered):
    registered(
        "shadowing_plugin", mlipdd_register_models=lambda register: register("lj", ModelWrapper)
    )
    with pytest.warns(RuntimeWarning, match="'lj'.*'builtin'.*'shadowing_plugin'"):
        reg = plugins.registry()
    assert reg.models["lj"].plugin == "builtin"
    (failure,) = reg.failed
    assert failure.name == "shadowing_plugin" and "shadows the core's name" in failure.error


def test_duplicate_preset_name_disables_both_plugins(registered):
    registered("first", mlipdd_register_presets=lambda register: register("SPEC_X", object()))
    registered("second", mlipdd_register_presets=lambda register: register("SPEC_X", object()))
    with pytest.warns(RuntimeWarning, match="'SPEC_X'.*'first'.*'second'"):
        reg = plugins.registry()
    assert "SPEC_X" not in reg.presets
    assert [f.name for f in reg.failed] == ["first", "second"]
    assert {"first", "second"}.isdisjoint(p.name for p in reg.plugins)


def test_a_name_registered_twice_by_one_plugin_disables_it(registered):
    def twice(register):
        register("twice", ModelWrapper)
        register("twice", ModelWrapper)

    registered("careless", mlipdd_register_models=twice)
    with pytest.warns(RuntimeWarning, match="registers model 'twice' twice"):
        reg = plugins.registry()
    assert "twice" not in reg.models and "lj" in reg.models


def test_plugin_with_unknown_hook_is_reported(registered):
    # A typo in a hook name would otherwise be silently ignored.
    registered("typo_plugin", mlipdd_register_model=lambda register: None)
    with pytest.warns(RuntimeWarning, match="mlipdd_register_model"):
        reg = plugins.registry()
    (failure,) = reg.failed
    assert failure.name == "typo_plugin" and "mlipdd_register_models" in failure.error


def test_plugin_whose_hook_raises_is_skipped_whole(registered):
    def register_models(register):
        register("half_registered", ModelWrapper)

    def register_presets(register):
        raise ValueError("upstream missing")

    registered(
        "crashing", mlipdd_register_models=register_models, mlipdd_register_presets=register_presets
    )
    with pytest.warns(RuntimeWarning, match="crashing.*upstream missing"):
        reg = plugins.registry()
    assert "half_registered" not in reg.models
    assert "crashing" not in [p.name for p in reg.plugins]
    assert reg.failed == [
        ("crashing", "mlipdd_register_presets raised ValueError: upstream missing")
    ]
    assert "lj" in reg.models


def test_unregister_plugin_removes_its_models(registered):
    registered(
        "temporary", mlipdd_register_models=lambda register: register("temp_model", ModelWrapper)
    )
    assert "temp_model" in plugins.registry().models
    plugins.unregister_plugin("temporary")
    assert "temp_model" not in plugins.registry().models


def test_unknown_model_and_preset_list_the_known_ones():
    with pytest.raises(plugins.UnknownNameError, match=r"unknown model 'nope'; known models: .*lj"):
        plugins.create_model("nope")
    with pytest.raises(LookupError, match=r"unknown preset 'SPEC_NOPE'"):
        plugins.get_preset("SPEC_NOPE")


def test_wrap_model_through_a_plugin_hook(installed_fixtures):
    load_with_fixtures()
    from mlipdd_fixture_good.raw import RawHarmonic

    wrapped = plugins.wrap_model(RawHarmonic(stiffness=3.0), scale=2.0)
    assert isinstance(wrapped, ModelWrapper) and wrapped.stiffness == 6.0
    assert plugins.wrap_model(wrapped) is wrapped


def test_wrap_model_of_unknown_type_says_what_to_install():
    class Unrecognised:
        pass

    with pytest.raises(
        plugins.PluginError, match="no installed mlipdd plugin recognises.*Unrecognised"
    ):
        plugins.wrap_model(Unrecognised())
    Unrecognised.__module__ = "fairchem.core.models.uma"
    with pytest.raises(plugins.PluginError, match=r"pip install 'mlipdd\[uma\]'"):
        plugins.wrap_model(Unrecognised())


def test_wrap_model_rejects_a_hook_that_returns_no_wrapper(registered):
    registered("sloppy", mlipdd_wrap_model=lambda model, options: "not a wrapper")
    with pytest.raises(plugins.PluginError, match="must return a ModelWrapper"):
        plugins.wrap_model(object())


def test_plugins_command_json_in_process(installed_fixtures, capsys):
    load_with_fixtures()
    assert main(["plugins", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert {"name": "fixture_good", "dist": "mlipdd-fixture-good", "version": "1.2.3"} in listing[
        "plugins"
    ]
    assert listing["models"]["fixture_harmonic"]["plugin"] == "fixture_good"
    assert listing["presets"]["SPEC_FIXTURE_GOOD"] == "fixture_good"
    assert [f["name"] for f in listing["failed"]] == ["fixture_broken"]
    assert main(["plugins", "--json", "--strict"]) == 1


def test_plugins_command_output_from_the_installed_script(installed_fixtures):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(installed_fixtures), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop(plugins.AUTOLOAD_ENV_VAR, None)
    result = subprocess.run(
        [str(MLIPDD_SCRIPT), "plugins"], env=env, capture_output=True, text=True, check=True
    )
    out = result.stdout
    assert "builtin" in out and "mlipdd 0." in out
    assert "fixture_good" in out and "mlipdd-fixture-good 1.2.3" in out
    assert "fixture_harmonic" in out and "[fixture_good]" in out
    assert "SPEC_FIXTURE_GOOD" in out
    failed_section = out.split("Failed plugins (skipped):", 1)[1]
    assert "fixture_broken" in failed_section and "fails on purpose" in failed_section
    # The warning goes to stderr so that scripts reading stdout are not disturbed.
    assert "fixture_broken" in result.stderr

    env[plugins.AUTOLOAD_ENV_VAR] = "1"
    quiet = subprocess.run(
        [str(MLIPDD_SCRIPT), "plugins"], env=env, capture_output=True, text=True, check=True
    )
    assert "autoload off" in quiet.stdout and "fixture" not in quiet.stdout
