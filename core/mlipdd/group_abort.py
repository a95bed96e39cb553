"""Tearing a process group down without waiting for anyone: what `mlipdd.comm.fail_together`
needs.

# NOTE [aborting a group]
On gloo, closing the failing rank's connections (``destroy_process_group``) makes the
peers' pending collectives fail at once. NCCL differs on both sides: destroying a
communicator waits for the peers (the failing rank blocks in ``destroy_process_group``),
and a peer's kernel that waits for a rank which stopped sending never fails by itself,
only at the collective timeout, minutes later. So on NCCL:

* the failing rank publishes its message in the store, then *aborts* its communicators
  (``ncclCommAbort`` through torch's process-group abort), which returns at once;
* every rank runs a small watcher thread (started by the first fail-together block)
  that polls the store; when another rank's failure appears it aborts its own
  communicators, so its pending collective returns with an error, and the main thread
  raises the failing rank's message (``RemoteRankError``).

On both backends the failing rank then waits (a few seconds at most) until the peers
acknowledge the message, because rank 0 hosts the store and would take it along when
its process ends.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch.distributed as dist

FAILURE_KEY = "mlipdd/failure"
ACK_KEY = "mlipdd/failure_seen"
ACK_WAIT_S = 5.0  # how long the failing rank keeps the store up for the peers to read it
POLL_S = 0.2  # how often the watcher looks at the store

_watcher: _Watcher | None = None
_seen: tuple[int, str] | None = None  # a peer's failure, as the watcher read it


def is_nccl(group=None) -> bool:
    return dist.is_initialized() and dist.get_backend(group) == "nccl"


def abort_group() -> None:
    """Abort every communicator of this process (NCCL) or destroy the group (gloo).

    Never waits for another rank. Afterwards the process has no process group.
    """
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        with contextlib.suppress(Exception):
            if abort is not None:
                abort()
                return
        _abort_backends()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _abort_backends() -> None:
    """The C++ half of an abort only (safe from another thread: the main thread's Python
    bookkeeping of the groups is left for it to clear)."""
    for pg in list(dist.distributed_c10d._world.pg_map):
        with contextlib.suppress(Exception):
            pg.abort()


# ---- the store ----------------------------------------------------------------------------
def publish(store, rank: int, text: str) -> None:
    """First failure wins; later ones (the peers' consequential errors) are ignored."""
    with contextlib.suppress(Exception):
        store.compare_set(FAILURE_KEY, "", f"{rank}|{text}")


def read_failure(store) -> tuple[int, str] | None:
    if _seen is not None:
        return _seen
    if store is None:
        return None
    try:
        if store.check([FAILURE_KEY]):
            rank, text = store.get(FAILURE_KEY).decode().split("|", 1)
            return int(rank), text
    except Exception:  # noqa: BLE001 - the store may be gone with its host
        return None
    return None


def acknowledge(store) -> None:
    with contextlib.suppress(Exception):
        store.add(ACK_KEY, 1)


def wait_for_acknowledgements(store, peers: int, timeout: float = ACK_WAIT_S) -> None:
    """Until ``peers`` ranks have read the failure, or ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if store.add(ACK_KEY, 0) >= peers:
                return
        except Exception:  # noqa: BLE001 - store gone: nobody left to wait for
            return
        time.sleep(0.05)


# ---- the watcher (NCCL) -------------------------------------------------------------------
class _Watcher(threading.Thread):
    def __init__(self, store, rank: int, world):
        super().__init__(name="mlipdd-failure-watcher", daemon=True)
        self.store, self.rank, self.world = store, rank, world

    def run(self) -> None:
        global _seen
        while dist.is_initialized():
            found = None
            with contextlib.suppress(Exception):
                if self.store.check([FAILURE_KEY]):
                    rank, text = self.store.get(FAILURE_KEY).decode().split("|", 1)
                    found = int(rank), text
            if found is not None:
                if found[0] != self.rank:
                    _seen = found
                    acknowledge(self.store)
                    _abort_backends()  # our pending NCCL collective now returns an error
                return
            time.sleep(POLL_S)


def watch_for_peer_failures(store, group=None) -> None:
    """Start this process's watcher once (NCCL only; gloo peers fail by themselves)."""
    global _watcher
    if store is None or not is_nccl(group):
        return
    world = dist.group.WORLD  # one watcher per default group
    if _watcher is not None and _watcher.is_alive() and _watcher.world is world:
        return
    _watcher = _Watcher(store, dist.get_rank(), world)
    _watcher.start()
