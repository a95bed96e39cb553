"""Shared settings of the AIMNet2 plugin tests: aimnet must be importable; spawned ranks
import it once, in the forkserver, instead of once per rank (it imports warp, seconds)."""

from __future__ import annotations

import os

_preload = "aimnet.models,aimnet.modules.lr,mlipdd_aimnet2.wrapper"
os.environ["MLIPDD_SPAWN_PRELOAD"] = ",".join(
    p for p in (os.environ.get("MLIPDD_SPAWN_PRELOAD", ""), _preload) if p
)

import pytest

pytest.importorskip("aimnet", reason="aimnet is not installed (see plugins/aimnet2/README.md)")
