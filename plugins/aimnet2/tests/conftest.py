"""Shared settings of the AIMNet2 plugin tests: aimnet must be importable; spawned ranks
import it once, in the forkserver, instead of once per rank (it imports warp, seconds)."""

from __future__ import annotations

import pytest
from mlipdd.testing.spawn import preload_in_forkserver

# in this process only: an environment variable would reach every program a test starts
preload_in_forkserver("aimnet.models", "aimnet.modules.lr", "mlipdd_aimnet2.wrapper")

pytest.importorskip("aimnet", reason="aimnet is not installed (see plugins/aimnet2/README.md)")
