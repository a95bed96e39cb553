"""Run a function on W real ranks (separate processes, gloo on CPU) and collect results.

Ranks come from a forkserver that has imported torch once, so a rank starts in a
fraction of a second and never inherits an OpenMP pool from the parent. A rank that
raises reports its traceback; the call raises `RankFailure` with every message. A run
that outlives ``timeout`` is killed and reported, never left hanging.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from mlipdd.comm import free_port
from mlipdd.distributed.rank_pool import (
    forkserver_context,
    forkserver_preload,
    preload_in_forkserver,
)

_CTX = None


class RankFailure(RuntimeError):
    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        text = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")


# Under pytest, a rank gets its function by importing the test module that defines it, and
# with it pytest and what test modules import; once in the server, not 0.3-1 s a rank a launch.
# The server is one per process and shared with `rank_pool.rank_context` (a calculator's
# ranks): whichever starts it first fixes its modules, so both read the same list.
_UNDER_PYTEST = ("pytest", "ase.build", "mlipdd.testing", "mlipdd.distributed.rank_worker")
# NOTE [compiler in the forkserver]: a rank's first `torch.compile` (even "aot_eager") imports
# dynamo, functorch's compilers and much of inductor: 5 s + 3 s of a loaded 2-core machine,
# in every rank of every compiled test (the compile itself then takes 0.2-0.4 s). Imported
# once in the server, a rank forks with them. Importing starts no thread (checked: one
# thread before and after), so the fork stays clean. Under pytest only: a user's
# calculator does not compile in its ranks.
_COMPILER = ("torch._dynamo", "functorch.compile", "torch._inductor.lowering", "torch.export._trace")
if "pytest" in sys.modules:
    preload_in_forkserver(*_UNDER_PYTEST, *_COMPILER)


def _context():
    global _CTX
    if _CTX is None:
        _CTX = forkserver_context()
        # Heavy model packages (a conftest's `preload_in_forkserver("mace.modules")`, or
        # MLIPDD_SPAWN_PRELOAD=mace.modules) are imported once in the server instead of once
        # per rank per test.
        _CTX.set_forkserver_preload(["torch", "mlipdd.shard", "mlipdd.distributed.model", *forkserver_preload()])
    return _CTX


def _worker(rank, world_size, port, fn, args, kwargs, results, backend, threads, stack_file):
    # A rank that hangs is asked for its Python stack (SIGUSR1) before it is killed: the
    # failure then says which collective or lock each rank waits in, not only "no result".
    stack_out = open(stack_file, "w")  # noqa: SIM115 - open for the life of the rank
    faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=False)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(threads),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        try:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        except BaseException:  # noqa: BLE001 - see NOTE [port race]
            results.put((rank, False, _NOT_JOINED + traceback.format_exc()))
            return
        out = fn(rank, world_size, *args, **kwargs)
        buffer = io.BytesIO()  # plain bytes: torch's queue pickling shares memory the rank frees on exit
        torch.save(_to_cpu(out), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - the rank is exiting anyway
                pass


def _to_cpu(obj):
    import torch

    if torch.is_tensor(obj):
        return obj.detach().cpu().clone().as_subclass(torch.Tensor)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _load(payload: bytes):
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout: float = 300.0,
              backend: str = "gloo", threads: int = 1, **kwargs) -> list[Any]:
    """``fn(rank, world_size, *args, **kwargs)`` on each rank; returns results by rank."""
    # NOTE [port race]: `free_port` hands the port back before rank 0 binds it, so on a
    # busy machine another process can take it first; under heavy load gloo's full-mesh
    # connect can also drop a peer ("Connection closed by peer"). Both fail before the
    # group exists, so no collective of `fn` ran: the launch stops at once (the peers
    # would wait out `timeout` in the half-built mesh) and runs again on a fresh port.
    for attempt in range(3):
        try:
            return _launch(fn, world_size, args, kwargs, timeout, backend, threads)
        except RankFailure as failure:
            if attempt == 2 or not any(m.startswith(_NOT_JOINED) for m in failure.failures.values()):
                raise
    raise AssertionError("unreachable")


_POLL_S = 2.0  # how often a launch checks for ranks that died without a result
_NOT_JOINED = "[the rank could not join the process group] "


def _launch(fn, world_size, args, kwargs, timeout, backend, threads) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    stacks = tempfile.mkdtemp(prefix="mlipdd-ranks-")
    stack_files = [os.path.join(stacks, f"rank{r}.stack") for r in range(world_size)]
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, results, backend, threads,
                                          stack_files[r]))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    failures: dict[int, str] = {}
    hung: list[int] = []
    try:
        waited = 0.0
        while len(collected) + len(failures) < world_size:
            try:
                rank, ok, payload = results.get(timeout=_POLL_S)
            except queue.Empty:
                waited += _POLL_S
                missing = sorted(set(range(world_size)) - set(collected) - set(failures))
                dead = [r for r in missing if not procs[r].is_alive()]
                if dead and results.empty():  # died without a word (a segfault, the OOM killer, bootstrap)
                    failures.update({r: f"the rank exited (code {procs[r].exitcode}) without a result" for r in dead})
                    continue
                if waited >= timeout:
                    where = _stacks_of(procs, stack_files, missing)
                    failures.update({r: f"no result within {timeout:.0f} s (hung)\n{where[r]}" for r in missing})
                    hung = missing
                    break
                continue
            waited = 0.0
            if ok:
                collected[rank] = _load(payload)
            else:
                failures[rank] = payload
                if payload.startswith(_NOT_JOINED):
                    break  # the group will not form: relaunch now, not after `timeout`
    finally:
        for r in hung:  # its stack is taken: waiting the 10 s below for it to exit is time lost
            if procs[r].is_alive():
                procs[r].kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        for f in stack_files:
            if os.path.exists(f):
                os.remove(f)
        os.rmdir(stacks)
    if failures:
        raise RankFailure(failures)
    return [collected[r] for r in range(world_size)]


def _stacks_of(procs, stack_files, ranks) -> dict[int, str]:
    """The Python stack of each hung rank in `ranks` (empty where it had already died)."""
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)
    out = {}
    for r in ranks:
        text = open(stack_files[r]).read().strip() if os.path.exists(stack_files[r]) else ""  # noqa: SIM115
        out[r] = f"its stack when it was stopped:\n{text}" if text else "(the rank had exited; no stack)"
    return out
