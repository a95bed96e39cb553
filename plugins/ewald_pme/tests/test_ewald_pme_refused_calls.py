"""After a refused call every rank is in the same state (issue 26 item 4).

A refusal that every rank agrees on (a zero cell at partition, NaN positions or a zero cell
at a forward's checks) leaves the process group up on every rank: each catches the error
and the next good call equals the first. An error inside the model's forward (a batch
without charges) cannot be agreed on, so the group is torn down on every rank; the next
call on that DistributedModel is refused on every rank with the same words, and a fresh
group makes a good call again. 2, 3 and 4 ranks, halo and sharded storage.
"""

from __future__ import annotations

import os

import pytest
import torch
from mlipdd.testing.spawn import run_ranks
from mlipdd_ewald_pme.testing import rock_salt

WORLD_SIZES = tuple(int(n) for n in os.environ.get("MLIPDD_CONFORMANCE_RANKS", "2,3,4").split(","))


def _zero_cell(batch):
    out = batch.clone()
    out.system["cell"] = torch.zeros_like(out.system["cell"])
    return out


def _refusal(call) -> str | None:
    """The error ``call()`` raised here (type and message), None if it ran."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test compares what every rank saw
        return f"{type(error).__name__}: {error}"
    return None


def refused_then_good(rank, world_size, strategy, store_path):
    import torch.distributed as dist
    from mlipdd.distributed import DistributedModel, DomainConfig
    from mlipdd_ewald_pme.wrappers import EwaldWrapper

    good = rock_salt((2, 2, 2), seed=3)
    config = DomainConfig(cutoff=5.0, strategy=strategy, check_every=1)
    dm = DistributedModel(EwaldWrapper(cutoff=5.0), config)
    log = {"partition": _refusal(lambda: dm.partition(_zero_cell(good) if rank == 0 else None)),
           "up after partition": dist.is_initialized()}
    owned = dm.partition(good if rank == 0 else None)
    log["first"] = dm(owned)["energy"].detach()

    nan = owned.clone()
    if rank == world_size - 1 and nan.num_atoms:
        nan.node["positions"] = nan.positions.clone().index_fill_(0, torch.tensor([0]), float("nan"))
    log["nan"] = _refusal(lambda: dm(nan))
    log["after nan"] = dm(owned)["energy"].detach()
    log["zero cell"] = _refusal(lambda: dm(_zero_cell(owned)))
    log["after zero cell"] = dm(owned)["energy"].detach()

    no_charges = owned.clone()
    del no_charges.node["charges"]
    log["in model"] = _refusal(lambda: dm(no_charges))
    log["up after model"] = dist.is_initialized()
    log["same model again"] = _refusal(lambda: dm(owned))

    # a fresh group on a file store (the torn-down one's TCP store may be gone with rank 0)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    fresh = DistributedModel(EwaldWrapper(cutoff=5.0), config)
    log["fresh group"] = fresh(fresh.partition(good if rank == 0 else None))["energy"].detach()
    return log


@pytest.mark.parametrize("strategy", ["halo", "sharded"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_goes_on_after_a_refusal(world_size, strategy, tmp_path):
    logs = run_ranks(refused_then_good, world_size, strategy, str(tmp_path / "store"), timeout=180)
    first = logs[0]["first"]
    for rank, log in enumerate(logs):
        assert "singular" in log["partition"], (rank, log["partition"])
        assert log["up after partition"], rank
        assert "NaN" in log["nan"], (rank, log["nan"])
        assert "zero cell vector" in log["zero cell"] or "singular" in log["zero cell"], (rank, log["zero cell"])
        assert "add_node_property('charges'" in log["in model"], (rank, log["in model"])
        assert not log["up after model"], rank  # torn down on EVERY rank, none left waiting
        assert "was torn down on every rank" in log["same model again"], (rank, log["same model again"])
        for key in ("first", "after nan", "after zero cell", "fresh group"):
            assert torch.equal(log[key], first), (rank, key, log[key], first)
