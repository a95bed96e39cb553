"""NCCL check of failing together (catalogue F3): 2 GPUs, one rank fails inside the backward.

    python tests/faults/gpu_fail_together.py [--timeout SECONDS] [SCENARIO ...]

SCENARIO is ``RANK:KIND`` (KIND ``raise`` or ``oom``: a real CUDA out-of-memory error),
default ``1:raise 0:oom 1:oom``. One NCCL rank per GPU runs LJ MD under DomainParallel;
the chosen rank's 4th force backward fails while the other rank waits in the backward's
collectives. Prints, per rank, how many seconds after the failure it raised and what.
Each run ends within ``--timeout`` (the process group's collective timeout) + 45 s:
a rank still running then is reported as hung and killed. Needs one GPU per rank.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _rank(rank, port, fail_rank, kind, timeout_s, results, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        extra = {"device_id": device}
    else:  # gloo on the CPU: to try this script without GPUs
        device, extra = torch.device("cpu"), {}
    dist.init_process_group(
        backend, rank=rank, world_size=WORLD, timeout=timedelta(seconds=timeout_s), **extra
    )
    from mlipdd.distributed import DomainConfig, DomainParallel
    from mlipdd.dynamics import NVE
    from mlipdd.lattices import lj_liquid
    from mlipdd.testing.faults import FailsInBackward

    model = FailsInBackward(fail_rank, 4, kind).to(device)
    try:
        with DomainParallel(NVE(model, 2.0), DomainConfig(cutoff=model.cutoff), 50) as dp:
            dp.partition(lj_liquid(6, temperature=300.0, seed=1).to(device) if rank == 0 else None)
            dp.run()
        results.put((rank, time.time(), "finished without an error"))
    except BaseException as exc:  # noqa: BLE001 - reported
        results.put((rank, time.time(), f"{type(exc).__name__}: {exc}"))
    results.close()
    results.join_thread()  # the queue's feeder thread delivers before the hard exit
    sys.stdout.flush()
    os._exit(0)  # what the process group does at exit is not what is measured here


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scenario(fail_rank: int, kind: str, timeout_s: float, backend: str) -> list[str]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _port()
    procs = [
        ctx.Process(target=_rank, args=(r, port, fail_rank, kind, timeout_s, results, backend))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    got, deadline = {}, time.time() + timeout_s + 45  # + start-up (imports, CUDA, NCCL)
    while len(got) < WORLD and time.time() < deadline:
        try:
            rank, when, text = results.get(timeout=1.0)
            got[rank] = (when, text)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                break
    lines = []
    first = min((w for w, _ in got.values()), default=None)
    for r, p in enumerate(procs):
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
        if r in got:
            when, text = got[r]
            lines.append(f"rank {r}: raised {when - first:5.1f} s after the first: {text[:240]}")
        else:
            lines.append(f"rank {r}: NO RESULT (hung or crashed; exit code {p.exitcode})")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("scenarios", nargs="*", default=["1:raise", "0:oom", "1:oom"])
    args = parser.parse_args()
    if args.backend == "nccl":
        print(
            f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, "
            f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
            flush=True,
        )
    for item in args.scenarios:
        fail_rank, kind = item.split(":")
        start = time.time()
        lines = scenario(int(fail_rank), kind, args.timeout, args.backend)
        print(
            f"== rank {fail_rank} fails ({kind}); whole run {time.time() - start:.1f} s", flush=True
        )
        for line in lines:
            print("   " + line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
