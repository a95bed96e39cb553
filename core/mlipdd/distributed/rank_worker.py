"""One rank of a `RankPool` (`mlipdd.distributed.rank_pool`): the loop a spawned process
runs. It answers every request on its pipe, and a failed request does not end it.

NOTE [regrouping after a failure]
A request that fails on some rank leaves the process group in one of two states: intact
(an agreed check raised on every rank in step) or torn down (`fail_together` closed it
so that the peers waiting in a collective fail at once). Rather than tell the two apart,
every rank answers the failure and then joins a NEW group, rendezvous in a fresh file of
the pool's store directory (one per epoch). The ranks stay the same processes with the
same model, so the next call costs nothing more than usual. Only a rank that died or
hangs costs new processes; the parent sees to that (it kills the others and starts a new
pool at the next call).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import traceback

import torch

# replicated outputs; every other tensor output is per atom
SYSTEM_OUTPUTS = ("energy", "stress")


def die_with_parent(parent_pid: int) -> None:
    """End this process when the parent (the user's script) dies. A calculator's rank holds
    no run state worth saving, unlike `mlipdd run`'s ranks (`supervise.follow_launcher`), so
    it goes at once. Forked by the forkserver, its kernel parent is the server: the kernel's
    parent-death signal then follows the server, and a thread watches the script itself."""
    import threading
    import time

    from mlipdd.distributed.supervise import signal_on_parent_death

    forked_by_server = os.getppid() != parent_pid
    if not signal_on_parent_death(os.getppid() if forked_by_server else parent_pid, signal.SIGKILL):
        os._exit(1)

    def watch() -> None:
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass
            time.sleep(0.5)

    if forked_by_server:
        threading.Thread(target=watch, name="mlipdd-parent-watch", daemon=True).start()


def build_model_object(model_or_factory, device=None, dtype: torch.dtype | None = None):
    """The model itself, or what a zero-argument factory builds (every rank the same weights);
    moved to ``device`` and converted to ``dtype`` (as MACECalculator's default_dtype does)."""
    from torch import nn

    model = model_or_factory
    if not isinstance(model, nn.Module) and callable(model):
        model = model()
    if isinstance(model, nn.Module):
        if device is not None:
            model = model.to(device)
        if dtype is not None:
            model = model.to(dtype)
    return model


def rank_main(rank: int, world: int, store_dir: str, parent_pid: int, model, config, dtype,
              backend: str, device: str, collective_timeout_s: float, conn) -> None:
    die_with_parent(parent_pid)
    if backend == "gloo" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # share the cores
    from mlipdd.distributed.manager import DistributedManager
    from mlipdd.distributed.model import DistributedModel

    def join(epoch: int):
        import torch.distributed as dist

        dist.init_process_group(
            backend, init_method=f"file://{store_dir}/epoch{epoch}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        return DistributedManager(backend=backend, device=device)  # adopts the group

    try:
        manager = join(0)
        wrapper = build_model_object(model, manager.device, dtype)
        dm = DistributedModel(wrapper, config)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("failed", "start", f"rank {rank} could not start: {describe(exc)}", False))
        return
    # CPU seconds this process spent getting ready: a rank forked from the preloaded
    # forkserver imports nothing heavy itself (`rank_pool.rank_context`); tests hold it to that
    import time

    conn.send(("ready", time.process_time()))
    epoch = 0
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if request[0] == "stop":
            _leave_group()
            _exit_now()
        _, full, compute_stress = request
        try:
            result = evaluate(dm, full if rank == 0 else None, compute_stress)
            conn.send(("ok", result if rank == 0 else None))
            continue
        except BaseException as exc:  # noqa: BLE001 - answered; see NOTE [regrouping after a failure]
            conn.send(_failure(rank, exc))
        _leave_group()
        epoch += 1
        try:
            manager = join(epoch)
            dm = DistributedModel(wrapper, config)  # a clean decomposition for the next call
        except BaseException as exc:  # noqa: BLE001 - the parent sees this rank end
            conn.send(("failed", "regroup", f"rank {rank} could not rejoin: {describe(exc)}", False))
            return


def _exit_now() -> None:
    """End at once: a rank holds nothing to save, and the interpreter's own shutdown with
    torch loaded takes seconds (every calculator's close() waited for it)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _failure(rank: int, exc: BaseException) -> tuple:
    """``("failed", kind, text, relayed)``: kind "input" for bad input (the caller's to fix),
    relayed when this rank only reports another rank's error (that rank names the cause)."""
    from mlipdd.comm import DistributedInputError, RemoteRankError
    from mlipdd.data import InputError

    relayed = isinstance(exc, (RemoteRankError, DistributedInputError))
    if isinstance(exc, InputError):
        return ("failed", "input", str(exc), relayed)
    if isinstance(exc, FloatingPointError) or "FloatingPointError" in str(exc):
        return ("failed", "nonfinite", str(exc), relayed)  # the parent checks one process
    return ("failed", "error", f"rank {rank}: {describe(exc)}", relayed)


def _leave_group() -> None:
    import torch.distributed as dist

    from mlipdd import group_abort

    group_abort.abort_group()  # never waits for a peer; a no-op when fail_together did it
    with contextlib.suppress(Exception):  # NCCL's abort leaves Python's bookkeeping behind
        if dist.is_initialized():
            dist.destroy_process_group()


def describe(exc: BaseException) -> str:
    if isinstance(exc, (ValueError, TypeError, RuntimeError)) and str(exc):
        return f"{type(exc).__name__}: {exc}"
    return "".join(traceback.format_exception(exc)).strip()


def evaluate(dm, full, compute_stress: bool) -> dict[str, torch.Tensor] | None:
    """Collective: one force call on the ranks; rank 0 returns every output in atom order.
    All of it inside `fail_together`: an error on one rank (gathering included) must not
    leave the others waiting in a collective."""
    from mlipdd.comm import fail_together
    from mlipdd.distributed.hooks import gather_rows

    with fail_together(dm.group):
        owned = dm.partition(full)
        out = dm(owned, compute_stress=compute_stress)
        result = {k: out[k].detach().cpu() for k in SYSTEM_OUTPUTS if torch.is_tensor(out.get(k))}
        per_atom = sorted(k for k, v in out.items() if torch.is_tensor(v) and k not in SYSTEM_OUTPUTS)
        for name in per_atom:  # same names, same order on every rank
            rows = gather_rows(owned.atom_ids, out[name])
            if rows is not None:
                result[name] = rows
    return result if full is not None else None
