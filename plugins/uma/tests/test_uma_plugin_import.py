"""The skeleton UMA plugin imports and its hooks match the core's hookspecs."""

import mlipdd_uma
import pluggy
from mlipdd import hookspecs
from mlipdd_uma import plugin


def test_plugin_module_imports_and_validates_against_hookspecs():
    assert mlipdd_uma.__version__
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    manager.register(plugin, name="uma")
    manager.check_pending()  # every hook the plugin implements has a spec
