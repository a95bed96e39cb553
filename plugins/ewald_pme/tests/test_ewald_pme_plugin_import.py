"""The skeleton Ewald / PME plugin imports and its hooks match the core's hookspecs."""

import mlipdd_ewald_pme
import pluggy
from mlipdd import hookspecs
from mlipdd_ewald_pme import plugin


def test_plugin_module_imports_and_validates_against_hookspecs():
    assert mlipdd_ewald_pme.__version__
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    manager.register(plugin, name="ewald_pme")
    manager.check_pending()  # every hook the plugin implements has a spec
