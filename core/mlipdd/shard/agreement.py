"""Failing together: an error on one rank becomes the same error on every rank.

Two mechanisms, for the two ways a rank can fail:

* a check that every rank reaches (bad input, NaN output): `agree_on_errors` reduces
  a flag, gathers the messages and raises the same exception everywhere;
* an exception in the middle of collective code (the other ranks are already waiting
  in a collective): `fail_together` publishes the message in the process group's
  store and tears the group down, so the peers' pending collective fails at once;
  they catch that, read the message and raise it. No hang, no timeout to wait out.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from mlipdd.data import InputError

_STORE_KEY = "mlipdd/failure"


class RemoteRankError(RuntimeError):
    """Another rank failed; the message is that rank's error."""


class DistributedInputError(InputError):
    """Bad input found on some rank, raised on every rank with the same message."""


def group_rank(group=None) -> int:
    """This process's rank in ``group`` (0 when there is no process group)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def group_size(group=None) -> int:
    """The number of ranks in ``group`` (1 when there is no process group)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


_world = group_size


class OnGroup:
    """``rank`` and ``world_size`` of ``self.group`` for the classes that work on one."""

    group = None

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    @property
    def world_size(self) -> int:
        return group_size(self.group)


def _flag_device(group) -> torch.device:
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank when it is True on some rank (one tiny all_reduce)."""
    if _world(group) == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], device=_flag_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def agree_on_errors(error: BaseException | None, group=None) -> None:
    """Collective: raise the first failing rank's error on every rank."""
    if _world(group) == 1:
        if error is not None:
            raise error
        return
    if not any_rank(error is not None, group):
        return
    messages = [None] * _world(group)
    mine = None if error is None else (type(error).__name__, str(error), isinstance(error, InputError))
    dist.all_gather_object(messages, mine, group=group)
    rank, (kind, text, is_input) = next((r, m) for r, m in enumerate(messages) if m is not None)
    if error is not None and rank == dist.get_rank(group):
        raise error
    cls = DistributedInputError if is_input else RemoteRankError
    raise cls(f"rank {rank} failed: {kind}: {text}")


def check_together(fn, *args, group=None, **kwargs):
    """Run a rank-local check on every rank and agree on its outcome."""
    error = None
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
        error, result = exc, None
    agree_on_errors(error, group)
    return result


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (single process or a custom launcher)
        return None


@contextlib.contextmanager
def fail_together(group=None):
    """Around collective code: a local exception stops every rank with its message."""
    try:
        yield
    except (RemoteRankError, DistributedInputError):
        raise
    except Exception as exc:
        if _world(group) == 1:
            raise
        remote = _remote_failure()
        if remote is not None and remote[0] != dist.get_rank():
            raise RemoteRankError(f"rank {remote[0]} failed: {remote[1]}") from exc
        _publish_and_abort(exc)
        raise


def _remote_failure():
    store = _store()
    if store is None:
        return None
    try:
        if store.check([_STORE_KEY]):
            rank, text = store.get(_STORE_KEY).decode().split("|", 1)
            return int(rank), text
    except Exception:  # noqa: BLE001 - the store may be gone with the group
        return None
    return None


_KEPT_STORES = []


def _publish_and_abort(exc: BaseException) -> None:
    store = _store()
    if store is not None:
        _KEPT_STORES.append(store)  # rank 0 hosts the store: keep it alive for the peers
        try:
            store.compare_set(_STORE_KEY, "", f"{dist.get_rank()}|{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001, S110 - best effort: the peers still fail on the torn-down group
            pass
    # Tearing the group down closes its connections, which makes the peers' pending
    # collective fail now rather than at the timeout.
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
