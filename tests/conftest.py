"""Settings shared by the core and integration tests."""

from __future__ import annotations

import importlib.util

from mlipdd.testing.spawn import preload_in_forkserver

# Spawned ranks import mace once (in this process's forkserver), not once per rank. Not an
# environment variable: that would reach every program a test starts (`mlipdd run`, a
# user's script), and each would import mace in its own server first.
if importlib.util.find_spec("mace") is not None:
    preload_in_forkserver("mace.modules")
