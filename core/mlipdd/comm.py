"""The one communication module: who am I, on which device, how objects travel, and
how ranks fail together.

Everything in mlipdd that asks for a rank, a world size, a device for a collective or
sends Python objects between ranks goes through here, so the rules live in one place:

* ranks and sizes are those of a process group (0 and 1 with no process group);
* NCCL collectives run on this rank's current GPU, gloo ones on the CPU;
* object collectives name their root by its rank *in the group* (``group_src``),
  never by a global rank;
* "compute on rank 0, then agree on errors" (`compute_on_rank0`): rank 0 does the
  work, every rank learns whether it failed, and raises the same error if so.

Failing together (NOTE [failing together]) has two mechanisms, for the two ways a rank
can fail:

* a check that every rank reaches (bad input, NaN output): `agree_on_errors` reduces
  a flag, gathers the messages and raises the same exception everywhere;
* an exception in the middle of collective code (the other ranks are already waiting
  in a collective): `fail_together` publishes the message in the process group's
  store and tears the group down, so the peers' pending collective fails at once;
  they catch that, read the message and raise it. No hang, no timeout to wait out.

This module imports nothing of mlipdd but `mlipdd.data` (for `InputError`) and
`mlipdd.group_abort` (tearing a group down without waiting, NCCL included), so every
layer (shard, strategy, distributed, validate) may use it.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from mlipdd import group_abort
from mlipdd.data import InputError

T = TypeVar("T")



# ---- ranks and sizes ------------------------------------------------------------------------
def group_rank(group=None) -> int:
    """This process's rank in ``group`` (0 when there is no process group)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def group_size(group=None) -> int:
    """The number of ranks in ``group`` (1 when there is no process group)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


class OnGroup:
    """``rank`` and ``world_size`` of ``self.group`` for the classes that work on one."""

    group = None

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    @property
    def world_size(self) -> int:
        return group_size(self.group)


# ---- devices --------------------------------------------------------------------------------
def is_nccl(group=None) -> bool:
    """True when ``group``'s collectives run through NCCL (their tensors must be on a GPU)."""
    return dist.is_initialized() and dist.get_backend(group) == "nccl"


def nccl_device(group=None) -> torch.device | None:
    """This rank's current GPU under NCCL; None otherwise (the data may stay where it is)."""
    return torch.device("cuda", torch.cuda.current_device()) if is_nccl(group) else None


def collective_device(group=None) -> torch.device:
    """Where a small tensor made only for a collective (a flag, a count) must live."""
    return nccl_device(group) or torch.device("cpu")


def default_backend(use_cuda: bool) -> str:
    """NCCL when the ranks compute on GPUs, gloo on the CPU."""
    return "nccl" if use_cuda else "gloo"


def rank_device(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: its node-local GPU under NCCL, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


# ---- objects ----------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on this host now, for a local rendezvous (it can be taken before
    rank 0 binds it; `mlipdd.testing.spawn` retries that race)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broadcast_object(value: T | None, group=None, src: int = 0) -> T:
    """Collective: group rank ``src``'s ``value`` on every rank (pickled)."""
    if group_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=src)
    return box[0]


def scatter_objects(parts: list | None, group=None, src: int = 0):
    """Collective: group rank ``src`` holds one object per rank; each rank gets its own."""
    if group_size(group) == 1:
        return parts[0]
    out = [None]
    dist.scatter_object_list(out, parts if group_rank(group) == src else None,
                             group=group, group_src=src)
    return out[0]


def all_gather_objects(value, group=None) -> list:
    """Collective: every rank's ``value``, in group-rank order, on every rank."""
    if group_size(group) == 1:
        return [value]
    parts = [None] * group_size(group)
    dist.all_gather_object(parts, value, group=group)
    return parts


def gather_objects(value, group=None, dst: int = 0) -> list | None:
    """Collective: every rank's ``value`` in group-rank order on group rank ``dst``; None elsewhere."""
    if group_size(group) == 1:
        return [value]
    root = group_rank(group) == dst
    parts = [None] * group_size(group) if root else None
    dist.gather_object(value, parts, group=group, group_dst=dst)
    return parts


# ---- agreeing ---------------------------------------------------------------------------------
class RemoteRankError(RuntimeError):
    """Another rank failed; the message is that rank's error."""


class DistributedInputError(InputError):
    """Bad input found on some rank, raised on every rank with the same message."""


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank when it is True on some rank (one tiny all_reduce)."""
    if group_size(group) == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def agree_on_errors(error: BaseException | None, group=None) -> None:
    """Collective: raise the first failing rank's error on every rank."""
    if group_size(group) == 1:
        if error is not None:
            raise error
        return
    if not any_rank(error is not None, group):
        return
    mine = None if error is None else (type(error).__name__, str(error), isinstance(error, InputError))
    messages = all_gather_objects(mine, group)
    rank, (kind, text, is_input) = next((r, m) for r, m in enumerate(messages) if m is not None)
    if error is not None and rank == group_rank(group):
        # every rank raises now, in step, with the group intact: `fail_together` must not
        # tear the group down for it (rank 0 did, the peers did not: a caller that caught
        # the refusal and went on hung at its next collective)
        error.raised_on_every_rank = True
        raise error
    cls = DistributedInputError if is_input else RemoteRankError
    raise cls(f"rank {rank} failed: {kind}: {text}")


def check_together(fn: Callable[..., T], *args, group=None, **kwargs) -> T:
    """Run a rank-local check (or computation) on every rank and agree on its outcome."""
    error = None
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
        error, result = exc, None
    agree_on_errors(error, group)
    return result


def compute_on_rank0(fn: Callable[..., T], *args, group=None, **kwargs) -> T | None:
    """Collective: ``fn`` runs on group rank 0 only; its error is raised on every rank.

    Returns ``fn``'s result on rank 0 and None elsewhere; share it with
    `broadcast_object` or `scatter_objects`. Rank 0's own exception is raised unchanged
    there, the others raise `RemoteRankError` (or `DistributedInputError` for bad input).
    """
    if group_rank(group) != 0:
        agree_on_errors(None, group)
        return None
    return check_together(fn, *args, group=group, **kwargs)


# ---- failing together ---------------------------------------------------------------------------
# NOTE [failing together]
# `fail_together` is the single entry point for "an exception inside collective code
# must stop every rank". DistributedModel and DomainParallel wrap each collective
# section in it. Extend the teardown in `_publish_and_abort` (e.g. aborting a NCCL
# communicator) rather than adding a second mechanism.
def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (single process or a custom launcher)
        return None


@contextlib.contextmanager
def fail_together(group=None):
    """Around collective code: a local exception stops every rank with its message.

    The failing rank publishes its error in the store and aborts the group; the peers'
    pending collectives then fail and they raise that error (see NOTE [aborting a group]
    in `mlipdd.group_abort` for NCCL, where a watcher thread does the peers' abort).
    """
    if group_size(group) > 1:
        group_abort.watch_for_peer_failures(_store(), group)
    try:
        yield
    except (RemoteRankError, DistributedInputError):
        raise
    except Exception as exc:
        # an exception every rank raises together (agreed first, e.g. a clean stop on a
        # signal) is not a failure of this rank: nothing to publish, nothing to abort
        if group_size(group) == 1 or getattr(exc, "raised_on_every_rank", False):
            raise
        rank, store = dist.get_rank(), _store()
        remote = group_abort.read_failure(store)
        if remote is not None and remote[0] != rank:
            group_abort.acknowledge(store)
            group_abort.abort_group()  # no destroy: on NCCL it would wait for the failed rank
            raise RemoteRankError(f"rank {remote[0]} failed: {remote[1]}") from exc
        _publish_and_abort(exc, rank, store)
        raise


_KEPT_STORES = []


def _publish_and_abort(exc: BaseException, rank: int, store) -> None:
    peers = dist.get_world_size() - 1
    if store is not None:
        _KEPT_STORES.append(store)  # rank 0 hosts the store: keep it alive for the peers
        group_abort.publish(store, rank, f"{type(exc).__name__}: {exc}")
    # gloo: closing the connections fails the peers' pending collective now rather than
    # at the timeout; NCCL: abort, which (unlike destroy) does not wait for the peers
    group_abort.abort_group()
    if store is not None:
        group_abort.wait_for_acknowledgements(store, peers)
