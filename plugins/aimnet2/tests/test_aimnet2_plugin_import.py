"""The skeleton AIMNet2 plugin imports and its hooks match the core's hookspecs."""

import mlipdd_aimnet2
import pluggy
from mlipdd import hookspecs
from mlipdd_aimnet2 import plugin


def test_plugin_module_imports_and_validates_against_hookspecs():
    assert mlipdd_aimnet2.__version__
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    manager.register(plugin, name="aimnet2")
    manager.check_pending()  # every hook the plugin implements has a spec
