"""mlipdd.comm: ranks of a group, object collectives rooted at a group rank, and
"compute on rank 0, then agree on errors" on every rank."""

import pytest
import torch.distributed as dist
from mlipdd import comm
from mlipdd.data import InputError
from mlipdd.testing import run_ranks


def _outcome(fn, *args, **kwargs):
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return (type(exc).__name__, str(exc))


def _bad_input():
    raise InputError("the sample has no atoms; pass a batch with atoms")


def _crash():
    raise RuntimeError("disk full")


def _comm_worker(rank, world_size):
    # a subgroup without global rank 0: its root (group rank 0) is global rank 1
    sub = dist.new_group([1, 2])
    out = {
        "rank": comm.group_rank(), "size": comm.group_size(),
        "scatter": comm.scatter_objects([f"to {r}" for r in range(world_size)] if rank == 0 else None),
        "gather": comm.gather_objects(rank * 10),
        "all_gather": comm.all_gather_objects(rank),
        "on_rank0": comm.compute_on_rank0(lambda: "rank 0's value"),
        "input_error": _outcome(comm.compute_on_rank0, _bad_input),
        "crash": _outcome(comm.compute_on_rank0, _crash),
    }
    if rank in (1, 2):
        out["sub_rank"], out["sub_size"] = comm.group_rank(sub), comm.group_size(sub)
        out["sub_broadcast"] = comm.broadcast_object(f"from global {rank}", sub)
        out["sub_gather"] = comm.gather_objects(rank, sub)
        out["sub_on_rank0"] = comm.compute_on_rank0(lambda: rank, group=sub)
    return out


def test_communication_on_three_ranks_and_a_subgroup():
    parts = run_ranks(_comm_worker, 3, timeout=120)
    assert [p["rank"] for p in parts] == [0, 1, 2]
    assert {p["size"] for p in parts} == {3}
    assert [p["scatter"] for p in parts] == ["to 0", "to 1", "to 2"]
    assert parts[0]["gather"] == [0, 10, 20] and parts[1]["gather"] is None
    assert all(p["all_gather"] == [0, 1, 2] for p in parts)
    assert [p["on_rank0"] for p in parts] == ["rank 0's value", None, None]
    # rank 0 raises its own error; the others the same message, typed as input or remote
    assert parts[0]["input_error"] == ("InputError", "the sample has no atoms; pass a batch with atoms")
    for p in parts[1:]:
        assert p["input_error"][0] == "DistributedInputError"
        assert "rank 0 failed" in p["input_error"][1] and "pass a batch with atoms" in p["input_error"][1]
        assert p["crash"][0] == "RemoteRankError" and "RuntimeError: disk full" in p["crash"][1]
    assert parts[0]["crash"] == ("RuntimeError", "disk full")
    # the subgroup's root is its rank 0 (global rank 1), not global rank 0
    assert [(p["sub_rank"], p["sub_size"]) for p in parts[1:]] == [(0, 2), (1, 2)]
    assert [p["sub_broadcast"] for p in parts[1:]] == ["from global 1", "from global 1"]
    assert parts[1]["sub_gather"] == [1, 2] and parts[2]["sub_gather"] is None
    assert [p["sub_on_rank0"] for p in parts[1:]] == [1, None]


def test_without_a_process_group_everything_is_local():
    assert not dist.is_initialized()
    assert (comm.group_rank(), comm.group_size()) == (0, 1)
    assert comm.broadcast_object("x") == "x"
    assert comm.scatter_objects(["mine"]) == "mine"
    assert comm.gather_objects(3) == [3] and comm.all_gather_objects(3) == [3]
    assert comm.compute_on_rank0(lambda: 7) == 7
    assert comm.collective_device().type == "cpu" and comm.nccl_device() is None
    with pytest.raises(InputError, match="pass a batch"):
        comm.compute_on_rank0(_bad_input)
