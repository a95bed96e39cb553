"""Many cases on one set of spawned gloo ranks, each case reported as it finishes.

`mlipdd.testing.run_ranks` returns when every rank has returned; a rank that dies (a
crash in a kernel) or hangs is noticed only at its timeout, and what it finished is
lost. The zoo runs hundreds of cases per rank count, and an exception in a case tears
the process group down (`mlipdd.comm.fail_together`), so here:

* every rank streams one message per case, and the parent watches the processes: a
  rank that exits without its final message is lost at once, a set of ranks with no
  message for ``stall_s`` seconds is killed;
* after an exception the ranks stay alive and join a NEW group (an epoch, rendezvous in
  a fresh file store), agree there on the first case not finished by all (an
  all_gather), and resume after it; only a lost rank costs new processes;
* after each case the ranks gather their case index (`_check_in_step`), so a rank
  that skipped a collective is caught in that case, not blamed on a later one (gloo
  pairs collectives by order, not by name).

Ranks come from the same forkserver as `run_ranks` (torch preloaded).
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field

from mlipdd.testing import spawn

OUT_OF_STEP = "ranks out of step"
BETWEEN_CASES = "failed between cases"


@dataclass
class CaseReport:
    """One case: every rank's result, or the errors and lost ranks that stopped it."""

    done: list | None = None  # per rank, when every rank finished the case
    errors: list[tuple[int, str, bool]] = field(default_factory=list)  # (rank, first line, relayed)
    lost: list[str] = field(default_factory=list)  # why a rank was lost (died, no progress)


def _check_in_step(index: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    mine = torch.tensor([index, 7919])
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    if any(other.tolist() != mine.tolist() for other in everyone):
        raise RuntimeError(f"{OUT_OF_STEP} after case {index}: the ranks issued different collectives")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _rank_main(rank, world_size, store_dir, first, run_case, cases, results, collective_timeout_s):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from mlipdd.comm import RemoteRankError

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    epoch, start = 0, first
    try:
        while True:
            dist.init_process_group("gloo", init_method=f"file://{store_dir}/epoch{epoch}", rank=rank,
                                    world_size=world_size, timeout=timeout)
            if epoch > 0:  # resume after the first case not finished on every rank
                stopped = [torch.empty(1, dtype=torch.long) for _ in range(world_size)]
                dist.all_gather(stopped, torch.tensor([start]))
                start = min(int(s) for s in stopped) + 1
            failed_at = None
            for index in range(start, len(cases)):
                try:
                    out = run_case(rank, world_size, cases[index])
                    _check_in_step(index, world_size)
                except Exception as exc:  # noqa: BLE001 - classified by the parent
                    results.put((rank, epoch, index, "error", (_first_line(exc), isinstance(exc, RemoteRankError))))
                    failed_at = index
                    break
                buffer = io.BytesIO()  # plain bytes, as run_ranks sends them
                torch.save(spawn._to_cpu(out), buffer)
                results.put((rank, epoch, index, "ok", buffer.getvalue()))
            if dist.is_initialized():  # an exception every rank agreed on leaves the group up
                dist.destroy_process_group()
            if failed_at is None or failed_at + 1 >= len(cases):
                break
            epoch, start = epoch + 1, failed_at
        results.put((rank, None, None, "end", None))
    except Exception:  # noqa: BLE001 - a failure outside any case: the parent relaunches
        results.put((rank, None, None, "lost", traceback.format_exc().strip().splitlines()[-1]))


def run_cases(run_case, world_size: int, cases: list, collective_timeout_s: float = 15.0,
              stall_s: float = 120.0) -> list[CaseReport]:
    """``run_case(rank, world_size, case)`` for every case, in order, on ``world_size`` ranks.

    A collective that waits longer than ``collective_timeout_s`` raises (a rank that
    skipped it would leave its peers waiting for the default 30 minutes)."""
    reports: list[CaseReport | None] = [None] * len(cases)
    first, retried = 0, set()
    while first < len(cases):
        resume, between = _launch(run_case, world_size, cases, first, reports, collective_timeout_s, stall_s)
        if between and resume in retried:  # lost joining a new group twice at the same place
            reports[resume] = CaseReport(lost=[f"ranks {BETWEEN_CASES} twice before this case"])
            resume += 1
        elif between:
            retried.add(resume)
        first = resume
    return reports


def _launch(run_case, world_size, cases, first, reports, collective_timeout_s, stall_s) -> tuple[int, bool]:
    """Ranks from case ``first`` on until they end or one is lost; fills ``reports``;
    returns the case to start new ranks from, and whether ranks were lost between cases."""
    ctx = spawn._context()
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="mlipdd-idiom-zoo-")
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, store_dir, first, run_case, cases, results,
                                                  collective_timeout_s)) for r in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, dict[int, object]] = {}  # case -> rank -> result (a case runs once per launch)
    errors: dict[int, dict[int, tuple[int, str, bool]]] = {}  # epoch -> rank -> (case, text, relayed)
    ended, lost, last = set(), {}, time.monotonic()
    try:
        while len(ended) + len(lost) < world_size:
            try:
                rank, epoch, index, kind, payload = results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in ended and r not in lost and not p.is_alive():
                        lost[r] = f"rank {r} died (exit code {p.exitcode})"
                if not lost and time.monotonic() - last > stall_s:
                    lost.update({r: f"rank {r} made no progress for {stall_s:.0f} s (hung)"
                                 for r in range(world_size) if r not in ended})
                if lost:
                    break
                continue
            last = time.monotonic()
            if kind == "ok":
                done.setdefault(index, {})[rank] = spawn._load(payload)
            elif kind == "error":
                errors.setdefault(epoch, {})[rank] = (index, *payload)
            elif kind == "end":
                ended.add(rank)
            else:
                lost[rank] = f"rank {rank} {BETWEEN_CASES}: {payload}"
    finally:
        for p in procs:
            if lost and p.is_alive():
                p.kill()  # the group is broken: its other ranks can only wait for the lost one
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(store_dir, ignore_errors=True)
    return _fill_reports(reports, world_size, len(cases), first, done, errors, lost)


def _fill_reports(reports, world_size, n_cases, first, done, errors, lost) -> tuple[int, bool]:
    """Replay the epochs as the ranks took them (each resumes after the first case not
    finished by every rank) and return where new ranks start. A rank lost in a case
    (no error from it in that epoch) makes that case's report; one lost between cases
    (joining the next epoch) reports nothing: the next launch retries from there."""
    start = first
    for epoch in sorted(errors):
        if any(r not in errors[epoch] for r in lost):
            break  # a lost rank died or hung in this epoch
        stop = min(index for index, _, _ in errors[epoch].values())
        for index in range(start, stop):
            reports[index] = CaseReport(done=[done[index][r] for r in range(world_size)])
        reports[stop] = CaseReport(errors=[(r, text, relayed) for r, (i, text, relayed)
                                           in sorted(errors[epoch].items()) if i == stop])
        start = stop + 1
    index = start
    while index < n_cases and len(done.get(index, {})) == world_size:
        reports[index] = CaseReport(done=[done[index][r] for r in range(world_size)])
        index += 1
    if not lost or index >= n_cases:
        return n_cases, False
    if all(BETWEEN_CASES in why for why in lost.values()):
        return index, True
    epoch_errors = errors[max(errors)].values() if errors else []
    reports[index] = CaseReport(errors=[(-1, text, relayed) for i, text, relayed in epoch_errors if i == index],
                                lost=sorted(lost.values()))
    return index + 1, False
