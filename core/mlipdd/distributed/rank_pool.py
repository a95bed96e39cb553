"""Persistent ranks behind a single-process driver (the ASE calculator, the torch-sim
model): N processes form a process group once, then evaluate one full system per request,
domain-decomposed. `ModelEvaluator` picks this process (``nproc=1``) or a `RankPool`.

The parent (the user's ASE script) is not a rank: it holds the full system and talks to
each rank over its own pipe. Per request every rank receives the command, rank 0 also the
system; the ranks partition it, run `DistributedModel`, gather per-atom outputs by atom id
to rank 0, and every rank answers (rank 0 with the results). The parent reads every answer
and watches the processes, so every call answers or raises within its deadline:

* a request that fails on the ranks (bad input, an error in the model) raises in the
  caller; the ranks regroup (NOTE [regrouping after a failure] in `rank_worker`) and the
  next call is served by the same processes;
* a rank that dies (named with its pid and signal), stays stopped (SIGSTOP) or does not
  answer within ``timeout`` fails the call; the other ranks are killed at once and the
  next call starts new ranks.

Several calculators may share one pool (``MLIPDDCalculator(pool=pool)``): an NEB's images
then run one after another on the same N ranks instead of N ranks each.

No orphans: a rank asks the kernel to kill it when its parent dies (Linux
``PR_SET_PDEATHSIG``) and leaves its loop when its pipe closes; `RankPool.close` stops the
ranks politely and kills any that do not stop.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

from mlipdd.distributed.main_guard import (
    MAIN_REIMPORT_EXIT_CODE,
    check_spawn_can_start,
    unguarded_main_message,
)
from mlipdd.distributed.rank_worker import build_model_object, rank_main

_START_TIMEOUT_S = 300.0  # model import and group formation on a busy machine
_STOP_TIMEOUT_S = 10.0
_STOPPED_GRACE_S = 3.0  # a rank stopped (SIGSTOP) this long while a call waits fails the call
_DEFAULT_TIMEOUT_S = 300.0
_ANSWER_GRACE_S = 10.0


class WorkerError(RuntimeError):
    """A rank failed; the message names the rank and carries its error."""


class RankPool:
    """``nproc`` persistent ranks evaluating ``model``; see the module docstring.

    ``model``: a wrapper, a raw upstream model a plugin recognises, or a zero-argument
    factory (every rank then builds it; it must give identical weights). ``config``: the
    `DomainConfig` (default: the model's cutoff). ``dtype`` converts the model (as
    MACECalculator's ``default_dtype``); results come in that precision. ``timeout``: the
    seconds one call may take before it fails naming the ranks that did not answer (also
    the ranks' collective timeout). Give the pool to several calculators to share it;
    ``close()`` it (or use ``with``) when done.
    """

    def __init__(self, model, nproc: int = 2, config=None, device: str | None = None,
                 dtype: torch.dtype | None = None, timeout: float = _DEFAULT_TIMEOUT_S):
        from mlipdd.distributed.config import DomainConfig

        if int(nproc) < 1:
            raise ValueError(f"nproc must be at least 1, got {nproc}")
        check_spawn_can_start(model)
        self.nproc = int(nproc)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # in the parent: cutoff and dtype, and one process's answer when the ranks' is not finite
        self.reference_model = local_model(model, dtype)
        self.cutoff = float(self.reference_model.cutoff)
        self.dtype = dtype or model_dtype(self.reference_model)
        self.config = config if config is not None else DomainConfig(cutoff=self.cutoff)
        self.timeout = float(timeout)
        self._model, self._requested_dtype = model, dtype
        self._conns, self._procs = [], []
        self._store_dir = None
        self.closed = False
        self.starts = 0  # how many times ranks were started (1 + restarts after lost ranks)
        self.start_cpu_seconds: list[float] = []  # each rank's CPU time to get ready, last start
        self._start()

    # ---- starting and stopping ------------------------------------------------------------
    def _start(self) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        ctx = rank_context(self.reference_model, backend)
        self._store_dir = tempfile.mkdtemp(prefix="mlipdd-ranks-")
        for rank in range(self.nproc):
            rank_device = f"cuda:{rank % torch.cuda.device_count()}" if backend == "nccl" else "cpu"
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main, name=f"mlipdd-rank-{rank}", daemon=True,
                args=(rank, self.nproc, self._store_dir, os.getpid(), self._model, self.config,
                      self._requested_dtype, backend, rank_device, self.timeout, child_end),
            )
            proc.start()
            child_end.close()
            self._conns.append(parent_end)
            self._procs.append(proc)
        self.starts += 1
        try:
            answers = self._collect(_START_TIMEOUT_S, starting=True)
        except BaseException:
            self._kill()
            raise
        self.start_cpu_seconds = [float(answer[1]) for answer in answers]

    def close(self) -> None:
        """Stop every rank; idempotent. A closed pool serves no more calls."""
        self.closed = True
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        """Kill whatever still runs (after a lost rank the others can only wait for it)."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    # ---- one call -------------------------------------------------------------------------
    def evaluate(self, full, compute_stress: bool) -> dict[str, torch.Tensor]:
        """One force call on the full system (CPU batch); outputs in atom order."""
        from mlipdd.data import InputError

        if self.closed:
            raise WorkerError("this pool of ranks was closed; create a new MLIPDDCalculator (or RankPool)")
        self._replace_dead_ranks()
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(("compute", full if rank == 0 else None, compute_stress))
            except OSError:
                pass  # it died just now: `_collect` names it
        # past the ranks' own collective timeout, and the failing rank's wait for its peers
        # to read its message (`fail_together`): a rank that times out names itself first
        answers = self._collect(self.timeout + _ANSWER_GRACE_S)
        failed = [a for a in answers if a[0] == "failed"]
        if not failed:
            return answers[0][1]
        # every rank answered: the ranks regroup and serve the next call
        failed.sort(key=lambda a: a[3])  # the rank that failed first; those relaying it last
        for kind, error in (("input", InputError), ("nonfinite", FloatingPointError)):
            texts = [a[2] for a in failed if a[1] == kind]
            if texts:
                raise error(texts[0])
        raise WorkerError(f"{failed[0][2]}\n(the ranks are intact and serve the next call)")

    def _replace_dead_ranks(self) -> None:
        """New ranks when the last call lost one, or when one died between calls (the OOM
        killer, a stray kill): said in a warning naming it, then the call goes on."""
        import warnings

        dead = [self._death(r, p) for r, p in enumerate(self._procs) if not p.is_alive()]
        if dead:
            self._kill()
            warnings.warn(f"{'; '.join(dead)} between calls; starting new ranks", RuntimeWarning,
                          stacklevel=4)
        if not self._procs:
            self._start()

    def _collect(self, timeout: float, starting: bool = False) -> list[tuple]:
        """One answer per rank, within ``timeout`` seconds. A rank that dies, stays stopped
        or does not answer raises `WorkerError` naming it; the other ranks are killed."""
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout
        answers: list[tuple | None] = [None] * self.nproc
        stopped_since: dict[int, float] = {}
        lost: dict[int, str] = {}
        def start_failed() -> bool:  # its peers may wait in the rendezvous: do not wait for them
            return any(a is not None and a[0] == "failed" and a[1] == "start" for a in answers)

        while any(a is None for a in answers) and not lost and not start_failed():
            pending = [r for r, a in enumerate(answers) if a is None]
            # wakes at an answer or a rank's exit; the timeout only paces the stopped/deadline checks
            wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending], 0.25)
            for rank in pending:
                conn, proc = self._conns[rank], self._procs[rank]
                if conn.poll():
                    try:
                        answers[rank] = conn.recv()
                    except (EOFError, OSError):
                        pass  # it died: named below from its exit code
                if answers[rank] is None and not proc.is_alive():
                    proc.join(1.0)
                    lost[rank] = self._death(rank, proc)
                elif answers[rank] is None and _is_stopped(proc.pid):
                    since = stopped_since.setdefault(rank, time.monotonic())
                    if time.monotonic() - since > _STOPPED_GRACE_S:
                        lost[rank] = (f"rank {rank} (pid {proc.pid}) is stopped (SIGSTOP, Ctrl-Z or a "
                                      "debugger) and cannot answer")
                else:
                    stopped_since.pop(rank, None)
            if not lost and time.monotonic() > deadline:
                for rank, a in enumerate(answers):
                    if a is None:
                        lost[rank] = (f"rank {rank} (pid {self._procs[rank].pid}) did not answer "
                                      f"within {timeout:.0f} s")
        start_failures = [a[2] for a in answers if a is not None and a[0] == "failed" and a[1] == "start"]
        if lost or start_failures:
            why = "; ".join(lost[r] for r in sorted(lost)) if lost else start_failures[0]
            if MAIN_REIMPORT_EXIT_CODE in [p.exitcode for p in self._procs]:
                why = unguarded_main_message()
            elif not starting:
                why += "; the other ranks were stopped" + self._restart_note()
            self._kill()  # the group is broken: the others can only wait for the lost rank
            raise WorkerError(why)
        return answers  # type: ignore[return-value]

    def _death(self, rank: int, proc) -> str:
        from mlipdd.distributed.supervise import describe_exit

        code = proc.exitcode
        return f"rank {rank} (pid {proc.pid}) {describe_exit(code) if code is not None else 'died'}"

    def _restart_note(self) -> str:
        return "" if self.closed else "; the next call starts new ranks"


# NOTE [forkserver preload]: modules this process's forkserver imports once besides the
# model's own. MLIPDD_SPAWN_PRELOAD reaches every program this process starts, and each then
# imports them in its own server (seconds a program, fairchem's ~10 s); `preload_in_forkserver`
# stays in this process: the test suite's conftests register their model packages there.
_PRELOAD_HERE: list[str] = []


def preload_in_forkserver(*modules: str) -> None:
    """Have this process's forkserver (`rank_context`, `mlipdd.testing.spawn`) import
    ``modules`` when it starts; children of this process do not inherit the list."""
    _PRELOAD_HERE.extend(m for m in modules if m not in _PRELOAD_HERE)


def forkserver_preload() -> list[str]:
    """MLIPDD_SPAWN_PRELOAD's modules, then those `preload_in_forkserver` added."""
    named = [m for m in os.environ.get("MLIPDD_SPAWN_PRELOAD", "").split(",") if m]
    return [*named, *(m for m in _PRELOAD_HERE if m not in named)]


def forkserver_context():
    """The forkserver context, its server told to count CUDA devices by NVML.

    NOTE [CUDA in the forkserver]: torch.cuda.is_available() (which packages call when the
    server imports them) asks the CUDA runtime for a device count unless told to ask NVML,
    and that leaves every process forked from the server unable to use CUDA ("Cannot
    re-initialize CUDA in forked subprocess": every gloo rank on a GPU). NVML's count is
    the same answer."""
    import multiprocessing

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return multiprocessing.get_context("forkserver")


def rank_context(model, backend: str):
    """Where ranks come from. On the CPU (gloo): a forkserver that imported torch, mlipdd and
    the model's own packages once (MACE: e3nn and mace, seconds each), so a rank forks from
    it ready instead of importing them itself, and a second pool (another calculator, new
    ranks after a lost one) starts in a fraction of a second. With CUDA (NCCL): spawn, a
    fresh interpreter per rank, since a package imported in the server may have touched
    the CUDA driver, which a forked child cannot use then. Never a plain fork of this
    process: it may hold threads (and CUDA) that a fork would copy. Either way each rank
    imports the main program (see `mlipdd.distributed.main_guard`).

    The server is one per process and shared with `mlipdd.testing.spawn`: the first pool
    (or test run) that starts it fixes what it preloads, so a later pool of another model
    family imports its packages in each rank. ``MLIPDD_SPAWN_PRELOAD`` (comma-separated
    modules, e.g. ``mace.modules``) adds modules to the first start, as the test suite does."""
    import multiprocessing

    if backend == "nccl":
        return multiprocessing.get_context("spawn")
    ctx = forkserver_context()
    modules = ["torch", "mlipdd.distributed.rank_worker", "mlipdd.distributed.model"]
    modules += forkserver_preload()
    for part in (model, getattr(model, "model", None)):  # the wrapper and what it wraps
        module = type(part).__module__ if part is not None else ""
        if module and module not in ("builtins", "__main__") and not module.startswith("torch."):
            modules.append(module)
    ctx.set_forkserver_preload(modules)  # takes effect when the server starts (once per process)
    return ctx


def _is_stopped(pid: int) -> bool:
    from mlipdd.distributed.supervise import _process_state

    return _process_state(pid) in ("T", "t")


def local_model(model, dtype: torch.dtype | None = None):
    """The wrapper this process can inspect (cutoff, dtype, elements): a raw upstream model
    is wrapped by the plugin that recognises it."""
    from torch import nn

    local = build_model_object(model, dtype=dtype)
    if not isinstance(local, nn.Module) or not hasattr(local, "model_config"):
        from mlipdd.plugins import wrap_model

        local = wrap_model(local if dtype is None else local.to(dtype))
    return local


def model_dtype(model) -> torch.dtype:
    floating = [t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    return floating[0] if floating else torch.float64


class ModelEvaluator:
    """One model, evaluated on this process (``nproc=1``), on N persistent ranks of its
    own, or on a shared `RankPool` (``pool=``).

    ``model`` is a wrapper, a raw upstream model a plugin recognises, or a zero-argument
    factory. ``evaluate(full_batch, compute_stress)`` returns detached outputs with per-atom
    rows in the batch's atom order, after checking that they are finite (every call is a
    new geometry). ``close()`` stops ranks it started (atexit does it otherwise); a shared
    pool is its owner's to close.
    """

    def __init__(self, model=None, nproc: int = 1, config=None, device: str | None = None,
                 dtype: torch.dtype | None = None, pool: RankPool | None = None,
                 timeout: float = _DEFAULT_TIMEOUT_S):
        import atexit
        import weakref

        if int(nproc) < 1:
            raise ValueError(f"nproc must be at least 1, got {nproc}")
        self.pool, self._owns_pool, self.model = pool, False, None
        if pool is not None:
            given = {"model": model is not None, "nproc": int(nproc) != 1, "config": config is not None,
                     "device": device is not None, "dtype": dtype is not None}
            if any(given.values()):  # the pool's own settings hold: a second set would be ignored
                names = ", ".join(k for k, v in given.items() if v)
                raise ValueError(f"with pool= the pool's model and settings hold; give {names} to "
                                 "RankPool(...) instead")
            self.nproc, self.device, self.dtype, self.cutoff = pool.nproc, pool.device, pool.dtype, pool.cutoff
            return
        if model is None:
            raise ValueError("give a model (a wrapper, a raw MACE/UMA model or a factory) or pool=")
        self.nproc = int(nproc)
        if self.nproc > 1:
            self.pool = RankPool(model, self.nproc, config, device, dtype, timeout)
            self._owns_pool = True
            self.device, self.dtype, self.cutoff = self.pool.device, self.pool.dtype, self.pool.cutoff
            # weak: atexit must not keep the evaluator (and its ranks) alive
            self._finalizer = weakref.finalize(self, self.pool.close)
            atexit.register(self._finalizer)
            return
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = local_model(model, dtype).to(self.device)
        self.dtype = dtype or model_dtype(self.model)
        self.cutoff = float(self.model.cutoff)

    @property
    def pids(self) -> list[int]:
        return self.pool.pids if self.pool is not None else []

    @property
    def local_model(self):
        """The model in this process (the pool's reference copy at ``nproc > 1``), in the
        evaluation's dtype: for what the caller asks the wrapper itself (its E0s)."""
        return self.model if self.pool is None else self.pool.reference_model

    def evaluate(self, batch, compute_stress: bool) -> dict[str, torch.Tensor]:
        if self.pool is None:
            out = _run_here(self.model, batch.to(self.device), compute_stress)
            check_finite(out)
            return out
        try:
            out = self.pool.evaluate(batch.to(device="cpu"), compute_stress)
            check_finite(out)
        except FloatingPointError as distributed:
            # is it the model (NaN on one process too) or the decomposition? one process says
            check_finite(_run_here(self.pool.reference_model, batch.to(device="cpu"), compute_stress))
            raise FloatingPointError(
                f"{distributed}\n(one process gives finite results for this geometry: the distributed "
                "evaluation differs from it; run mlipdd.validate.trace_and_validate on the model)"
            ) from None
        return out

    def close(self) -> None:
        """Stop the ranks this evaluator started (not a shared pool's); safe to call twice."""
        if self._owns_pool and self.pool is not None:
            import atexit

            self._finalizer()
            atexit.unregister(self._finalizer)
        self.pool = None if self._owns_pool else self.pool


def _run_here(model, batch, compute_stress: bool) -> dict[str, torch.Tensor]:
    with torch.enable_grad():  # forces come from autograd, even under a caller's no_grad
        out = model(batch, compute_stress=compute_stress)
    return {k: v.detach() for k, v in out.items() if torch.is_tensor(v)}


def check_finite(out: dict[str, torch.Tensor]) -> None:
    """Raise `FloatingPointError` naming the output (and atoms) that are NaN or inf."""
    for name in ("energy", "forces", "stress", "energies"):
        value = out.get(name)
        if value is None or bool(torch.isfinite(value).all()):
            continue
        where = ""
        if name in ("forces", "energies"):
            bad = torch.nonzero(~torch.isfinite(value.reshape(value.shape[0], -1)).all(1)).flatten()
            where = f" at atoms {bad[:8].tolist()}{' ...' if len(bad) > 8 else ''}"
        raise FloatingPointError(
            f"the model returned a non-finite {name}{where} for this geometry; check the structure "
            "(atoms far closer than a bond, or far from anything the model was trained on) and the "
            "model (an element it has no data for, a float32 model past its range)"
        )
