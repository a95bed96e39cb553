"""One spawned gloo group that runs many cases and reports each as it finishes.

`mlipdd.testing.run_ranks` returns when every rank has returned; a rank that dies
(a crash in a kernel) or hangs is noticed only at its timeout, and what it finished
is lost. The zoo runs hundreds of cases per group and some idioms crash or hang a
rank, so here every rank streams one message per case and the parent watches the
processes: a rank that exits without its final message is ``lost`` at once, a group
with no message for ``stall_s`` seconds is killed, and the cases finished before
are kept. Ranks come from the same forkserver as `run_ranks` (torch preloaded).
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import time
import traceback
from dataclasses import dataclass, field

from mlipdd.comm import free_port
from mlipdd.testing import spawn

_PORT_TAKEN = "address already in use"


@dataclass
class GroupRun:
    """What each rank reported: finished cases by index, its first error, or why it was lost."""

    world_size: int
    done: list[dict[int, dict]] = field(default_factory=list)
    errors: dict[int, tuple[int, str, bool]] = field(default_factory=dict)  # rank -> (case, text, relayed)
    lost: dict[int, str] = field(default_factory=dict)  # rank -> why (exit code, stall)

    def stop(self, n_cases: int) -> int:
        """The first case not finished on every rank."""
        stops = [n_cases] + [index for index, _, _ in self.errors.values()]
        stops += [len(self.done[rank]) for rank in self.lost]
        return min(stops)


OUT_OF_STEP = "ranks out of step"


def _check_in_step(index: int, world_size: int) -> None:
    """After a case, every rank gathers every rank's case index: a rank that issued fewer
    collectives than its peers in that case (and ran ahead) is caught in that case, not
    blamed on a later one (gloo pairs collectives by order, not by name)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([index, 7919])
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    if any(other.tolist() != mine.tolist() for other in everyone):
        raise RuntimeError(f"{OUT_OF_STEP} after case {index}: the ranks issued different collectives")


def _rank_main(rank, world_size, port, run_case, cases, results, collective_timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from mlipdd.comm import RemoteRankError

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
    except Exception:  # noqa: BLE001 - reported; the parent relaunches on a taken port
        results.put((rank, None, "init", traceback.format_exc()))
        return
    try:
        for index, case in enumerate(cases):
            try:
                out = run_case(rank, world_size, case)
                _check_in_step(index, world_size)
            except Exception as exc:  # noqa: BLE001 - classified by the parent
                lines = str(exc).strip().splitlines()
                text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
                results.put((rank, index, "error", (text, isinstance(exc, RemoteRankError))))
                if rank == 0:
                    time.sleep(0.3)  # rank 0 hosts the store: let the peers read the failure first
                break
            buffer = io.BytesIO()  # plain bytes, as run_ranks sends them
            torch.save(spawn._to_cpu(out), buffer)
            results.put((rank, index, "ok", buffer.getvalue()))
        results.put((rank, None, "end", None))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - the rank is exiting anyway
                pass


def run_group(run_case, world_size: int, cases: list, collective_timeout_s: float = 15.0,
              stall_s: float = 120.0) -> GroupRun:
    """``run_case(rank, world_size, case)`` for each case on ``world_size`` ranks, in order,
    each rank stopping at its first exception. A collective that waits longer than
    ``collective_timeout_s`` raises (a rank that skipped it would leave its peers waiting
    for the default 30 minutes); ``stall_s`` without any message kills the group.
    Relaunched on a taken port (as run_ranks)."""
    for _ in range(3):
        run = _launch(run_case, world_size, cases, collective_timeout_s, stall_s)
        if run is not None:
            return run
    raise RuntimeError(f"could not start {world_size} gloo ranks: the port was taken three times")


def _launch(run_case, world_size, cases, collective_timeout_s, stall_s) -> GroupRun | None:
    ctx = spawn._context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, run_case, cases, results, collective_timeout_s))
             for r in range(world_size)]
    for p in procs:
        p.start()
    run = GroupRun(world_size, done=[{} for _ in range(world_size)])
    ended: set[int] = set()
    last = time.monotonic()
    try:
        while len(ended | set(run.lost)) < world_size:
            try:
                rank, index, kind, payload = results.get(timeout=0.5)
            except queue.Empty:
                for rank, p in enumerate(procs):
                    if rank not in ended and rank not in run.lost and not p.is_alive():
                        _drain(results, run, ended)
                        if rank not in ended:
                            run.lost[rank] = f"rank {rank} died (exit code {p.exitcode})"
                if time.monotonic() - last > stall_s:
                    for rank in set(range(world_size)) - ended - set(run.lost):
                        run.lost[rank] = f"rank {rank} made no progress for {stall_s:.0f} s (hung)"
                continue
            last = time.monotonic()
            if _record(run, ended, rank, index, kind, payload) == "port":
                return None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return run


def _drain(results, run, ended) -> None:
    while True:
        try:
            rank, index, kind, payload = results.get(timeout=0.2)
        except queue.Empty:
            return
        _record(run, ended, rank, index, kind, payload)


def _record(run, ended, rank, index, kind, payload) -> str | None:
    if kind == "ok":
        run.done[rank][index] = spawn._load(payload)
    elif kind == "error":
        run.errors[rank] = (index, *payload)
    elif kind == "end":
        ended.add(rank)
    elif kind == "init":
        if _PORT_TAKEN in payload.lower():
            return "port"
        run.lost[rank] = f"rank {rank} could not join the group: {payload.strip().splitlines()[-1]}"
    return None
