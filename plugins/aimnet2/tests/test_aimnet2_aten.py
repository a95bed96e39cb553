"""AIMNet2 under the aten dispatch (``DomainConfig(dispatch="aten")``): refused by name, on every rank.

The wrapper builds aimnet's dense neighbour tables from the edge list and drops self-edges
by comparing the edge index's two rows (``sender == receiver``): under the aten dispatch
those are local row numbers (an own image is another row), so ``aten::eq`` on them is
refused before any energy is computed. Until the wrapper hands the tables to the model
in a form the aten rules can place, every rank stops with the refusal (or its echo) and
its fix; nothing is computed silently. One launch per rank count (2, 3, 4), halo storage,
DSF Coulomb, the triclinic molecular crystal.
"""

from __future__ import annotations

import functools

import pytest
from aimnet2_systems import DSF_CUTOFF, triclinic_crystal
from mlipdd.testing import run_ranks
from mlipdd_aimnet2.testing import random_aimnet2_wrapper

FACTORY = functools.partial(random_aimnet2_wrapper, seed=0, dsf_cutoff=DSF_CUTOFF)


def _refused(rank, world_size):
    from mlipdd.distributed import DistributedModel, DomainConfig

    model = FACTORY()
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.3, strategy="halo", dispatch="aten"))
    owned = dm.partition(triclinic_crystal() if rank == 0 else None)
    try:
        dm(owned, compute_stress=True)
    except Exception as error:  # noqa: BLE001 - the refusal (this rank) or its echo (the others)
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_aimnet2_refused_by_name_under_aten(world_size):
    messages = run_ranks(_refused, world_size, timeout=600)
    assert all(m is not None for m in messages), messages
    assert any("refuses `aten::eq.Tensor`" in m and "atom row NUMBERS" in m and "Fix:" in m for m in messages), messages
