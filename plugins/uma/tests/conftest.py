"""Shared settings and systems for the UMA plugin tests.

Models are tiny (8 channels, lmax 1, 2 layers, 4 A) and systems have tens to a couple
of hundred atoms: the suite runs on a shared 2-core machine. Everything is float32.
"""

from __future__ import annotations

import os

# before anything imports huggingface_hub: the offline test must fail at once, not retry
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from mlipdd.testing.spawn import preload_in_forkserver

# spawned ranks import fairchem once, in the forkserver, instead of once per rank; in this
# process only (an environment variable would reach every program a test starts: ~10 s each)
preload_in_forkserver("fairchem.core.models.uma.escn_md", "mlipdd_uma.wrapper")

pytest.importorskip("fairchem.core", reason="fairchem-core is not installed (see plugins/uma/README.md)")
