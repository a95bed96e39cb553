"""Persistent ranks behind a single-process driver (the ASE calculator, the torch-sim
model): N processes form a process group once, then evaluate one full system per request,
domain-decomposed. `ModelEvaluator` picks this process (``nproc=1``) or a `RankPool`.

The parent (the user's ASE script) is not a rank: it holds the full system and talks to
each rank over its own pipe. Per request every rank receives the command, rank 0 also the
system; the ranks partition it, run `DistributedModel`, gather per-atom outputs by atom id
to rank 0, and every rank answers (rank 0 with the results). The parent reads every answer,
so a rank that failed or died is named instead of leaving the parent waiting.

No orphans: a rank asks the kernel to kill it when its parent dies (Linux
``PR_SET_PDEATHSIG``) and leaves its loop when its pipe closes; `RankPool.close` stops the
ranks politely and terminates any that do not stop.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from typing import Any

import torch

_START_TIMEOUT_S = 300.0  # model import and group formation on a busy machine
_STOP_TIMEOUT_S = 10.0
_SYSTEM_OUTPUTS = ("energy", "stress")  # replicated; every other tensor output is per atom


class WorkerError(RuntimeError):
    """A rank failed; the message names the rank and carries its error."""


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the parent dies (Linux; elsewhere the pipe's EOF stops it).
    A calculator's rank holds no run state worth saving, unlike `mlipdd run`'s ranks
    (`supervise.follow_launcher`), so it goes at once."""
    from mlipdd.distributed.supervise import signal_on_parent_death

    if not signal_on_parent_death(parent_pid, signal.SIGKILL):
        os._exit(1)


def build_model_object(model_or_factory):
    from torch import nn

    if isinstance(model_or_factory, nn.Module) or not callable(model_or_factory):
        return model_or_factory
    return model_or_factory()  # a factory: every rank builds the same weights itself


def _rank_main(rank: int, world: int, port: int, parent_pid: int, model, config, backend: str,
               device: str | None, conn) -> None:
    die_with_parent(parent_pid)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "gloo" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # share the cores
    from mlipdd.data import InputError
    from mlipdd.distributed.manager import DistributedManager
    from mlipdd.distributed.model import DistributedModel

    try:
        manager = DistributedManager(backend=backend, device=device, rank=rank, world_size=world)
        dm = DistributedModel(build_model_object(model).to(manager.device), config)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"rank {rank} could not start: {_describe(exc)}"))
        return
    conn.send(("ready", None))
    try:
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            if request[0] == "stop":
                return
            _, full, compute_stress = request
            try:
                result = _evaluate(dm, full if rank == 0 else None, compute_stress)
                conn.send(("ok", result if rank == 0 else None))
            except InputError as exc:  # agreed on every rank: the group is intact, keep serving
                conn.send(("input_error", str(exc)))
                # from a clean slate: the failed call may have left a half-updated decomposition
                dm = DistributedModel(dm.model, config)
            except BaseException as exc:  # noqa: BLE001 - the group is torn down: report, stop
                conn.send(("error", f"rank {rank}: {_describe(exc)}"))
                return
    finally:
        manager.cleanup()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (ValueError, TypeError, RuntimeError)) and str(exc):
        return f"{type(exc).__name__}: {exc}"
    return "".join(traceback.format_exception(exc)).strip()


def _evaluate(dm, full, compute_stress: bool) -> dict[str, torch.Tensor] | None:
    """Collective: one force call on the ranks; rank 0 returns every output in atom order."""
    from mlipdd.distributed.hooks import gather_rows

    owned = dm.partition(full)
    out = dm(owned, compute_stress=compute_stress)
    result = {k: out[k].detach().cpu() for k in _SYSTEM_OUTPUTS if torch.is_tensor(out.get(k))}
    for name in sorted(k for k, v in out.items() if torch.is_tensor(v) and k not in _SYSTEM_OUTPUTS):
        rows = gather_rows(owned.atom_ids, out[name])  # same names, same order on every rank
        if rows is not None:
            result[name] = rows
    return result if full is not None else None


class RankPool:
    """N persistent ranks serving force calls; see the module docstring."""

    def __init__(self, model, config, nproc: int, device: str):
        import multiprocessing

        from mlipdd.comm import free_port

        # spawn, never fork: the parent may hold threads (and CUDA) that a fork would copy
        ctx = multiprocessing.get_context("spawn")
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        port = free_port()
        self.nproc = nproc
        self._conns, self._procs = [], []
        for rank in range(nproc):
            rank_device = f"cuda:{rank % torch.cuda.device_count()}" if backend == "nccl" else "cpu"
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main, name=f"mlipdd-rank-{rank}", daemon=True,
                args=(rank, nproc, port, os.getpid(), model, config, backend, rank_device, child_end),
            )
            proc.start()
            child_end.close()
            self._conns.append(parent_end)
            self._procs.append(proc)
        try:
            self._answers(_START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def evaluate(self, full, compute_stress: bool) -> dict[str, torch.Tensor]:
        from mlipdd.data import InputError

        if not self.alive:
            raise WorkerError("the calculator's ranks have stopped (closed or failed); create a new "
                              "MLIPDDCalculator")
        for rank, conn in enumerate(self._conns):
            conn.send(("compute", full if rank == 0 else None, compute_stress))
        answers = self._answers(timeout=None)
        input_errors = [payload for kind, payload in answers if kind == "input_error"]
        if input_errors:  # every rank agreed on it: the ranks are intact and keep serving
            raise InputError(input_errors[0])
        return answers[0][1]

    def _answers(self, timeout: float | None) -> list[tuple[str, Any]]:
        """One answer per rank; a failed or dead rank raises `WorkerError` naming it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        answers: list[tuple[str, Any] | None] = [None] * self.nproc
        errors: list[str] = []
        while any(a is None for a in answers):
            for rank, (conn, proc) in enumerate(zip(self._conns, self._procs)):
                if answers[rank] is not None:
                    continue
                if conn.poll(0.02):
                    try:
                        answers[rank] = conn.recv()
                    except (EOFError, OSError):
                        answers[rank] = ("error", f"rank {rank} died (exit code {proc.exitcode})")
                elif not proc.is_alive():
                    answers[rank] = ("error", f"rank {rank} died (exit code {proc.exitcode})")
                if answers[rank] is not None and answers[rank][0] == "error":
                    errors.append(answers[rank][1])
            if deadline is not None and time.monotonic() > deadline:
                errors.append(f"ranks {[r for r, a in enumerate(answers) if a is None]} did not "
                              f"answer within {timeout:.0f} s")
                break
        if errors:
            self.close()  # the group is torn down: these ranks cannot serve again
            input_errors = [a[1] for a in answers if a is not None and a[0] == "input_error"]
            if input_errors:  # bad input seen by one rank only; the others report the teardown
                from mlipdd.data import InputError

                raise InputError(input_errors[0])
            # the rank that failed first says why; the others only report the teardown
            errors.sort(key=lambda e: "RemoteRankError" in e or "stopped" in e)
            raise WorkerError(errors[0])
        return answers  # type: ignore[return-value]

    def close(self) -> None:
        """Stop every rank; idempotent."""
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except (OSError, ValueError, BrokenPipeError):
                pass
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []


class ModelEvaluator:
    """One model, evaluated on this process (``nproc=1``) or on N persistent ranks.

    ``model`` is a wrapper, a raw upstream model a plugin recognises, or a zero-argument
    factory. ``evaluate(full_batch, compute_stress)`` returns detached outputs with per-atom
    rows in the batch's atom order. ``close()`` stops the ranks (atexit does it otherwise).
    """

    def __init__(self, model, nproc: int = 1, config=None, device: str | None = None,
                 dtype: torch.dtype | None = None):
        import atexit
        import weakref

        from torch import nn

        if int(nproc) < 1:
            raise ValueError(f"nproc must be at least 1, got {nproc}")
        self.nproc = int(nproc)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        local = build_model_object(model)
        if not isinstance(local, nn.Module) or not hasattr(local, "model_config"):
            from mlipdd.plugins import wrap_model

            local = wrap_model(local)  # a raw upstream model (MACE, UMA) its plugin recognises
        self.cutoff = float(local.cutoff)
        floating = [t.dtype for t in [*local.parameters(), *local.buffers()] if t.is_floating_point()]
        self.dtype = dtype or (floating[0] if floating else torch.float64)
        self.model = local.to(self.device) if self.nproc == 1 else None
        self.pool = None
        if self.nproc > 1:
            from mlipdd.distributed.config import DomainConfig

            config = config if config is not None else DomainConfig(cutoff=self.cutoff)
            self.pool = RankPool(model, config, self.nproc, str(self.device))
            # weak: atexit must not keep the evaluator (and its ranks) alive
            self._finalizer = weakref.finalize(self, self.pool.close)
            atexit.register(self._finalizer)

    @property
    def pids(self) -> list[int]:
        return self.pool.pids if self.pool is not None else []

    def evaluate(self, batch, compute_stress: bool) -> dict[str, torch.Tensor]:
        if self.pool is not None:
            return self.pool.evaluate(batch.to(device="cpu"), compute_stress)
        with torch.enable_grad():  # forces come from autograd, even under a caller's no_grad
            out = self.model(batch.to(self.device), compute_stress=compute_stress)
        return {k: v.detach() for k, v in out.items() if torch.is_tensor(v)}

    def close(self) -> None:
        """Stop the ranks (nothing to do for ``nproc=1``); safe to call twice."""
        if self.pool is not None:
            import atexit

            self._finalizer()
            atexit.unregister(self._finalizer)
            self.pool = None
