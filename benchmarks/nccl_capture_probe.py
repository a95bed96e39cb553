"""Can this machine capture NCCL collectives in a CUDA graph? (issue 22 item 2, a probe.)

    torchrun --nproc_per_node 1 benchmarks/nccl_capture_probe.py --out $OUT
    torchrun --nproc_per_node 2 benchmarks/nccl_capture_probe.py --out $OUT

A CUDA graph of a force call at several ranks must hold the exchanges the call makes. mlipdd
does not capture them yet (`DomainConfig(cuda_graph=True)` is refused at several ranks);
this probe checks, on the NCCL group torchrun starts (one rank forces the same code paths),
that each kind of exchange a captured call would need replays right and what it costs:

* ``system_sum``: `mlipdd.distributed.compiled_sums.system_sum` with owned rows (the
  per-system sums compiled at several ranks put in the graph: functional reduce-scatter and
  all-gather), forward and its backward (an all-reduce of the gradients);
* ``all_reduce``: c10d ``all_reduce`` in place (the energy and stress sums);
* ``all_to_all``: ``all_to_all_single`` with fixed splits (a halo exchange of ghost rows
  between rebuilds: the splits only change at a rebuild, which would recapture).

Each is captured once, replayed with new inputs (written into the static inputs in place),
and compared with the same exchange run eagerly on those inputs; a row says whether it
matched (``max diff``), and the median time of a replay vs the eager call. Writes
``nccl_capture_probe_<ranks>.md|json`` to ``--out`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import torch
import torch.distributed as dist


def _median_ms(fn, repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def _system_sum_case(rank, world, device):
    from mlipdd.distributed import compiled_sums

    rows, systems = 1000 + 17 * rank, 3
    x = torch.randn(rows, 4, device=device, requires_grad=True)
    index = torch.arange(rows, device=device) % systems
    owned = (torch.arange(rows, device=device) < 900).to(x.dtype)

    def call():
        # system_sum's local sum, then its collective called directly: at one rank system_sum
        # skips it (summing_over_ranks holds no group there), here the NCCL path runs at any count
        compiled_sums.RANKS.group, compiled_sums.RANKS.size = dist.group.WORLD, world
        try:
            local = torch.zeros(systems, 4, device=device).index_add(0, index, x * owned[:, None])
            total = compiled_sums._all_reduce(local)
            (grad,) = torch.autograd.grad((total * total).sum(), [x])
        finally:
            compiled_sums.RANKS.group, compiled_sums.RANKS.size = None, 1
        return torch.cat([total.reshape(-1), grad.reshape(-1)])

    def refresh():
        with torch.no_grad():
            x.copy_(torch.randn_like(x))

    def eager_reference():
        with torch.no_grad():
            part = torch.zeros(systems, 4, device=device).index_add(0, index, x * owned[:, None])
            dist.all_reduce(part)
        return torch.cat([part.reshape(-1), (2 * part[index] * owned[:, None]).reshape(-1) * world])

    return call, refresh, eager_reference


def _all_reduce_case(rank, world, device):
    buffer = torch.randn(3, 3, 3, device=device)
    source = buffer.clone()

    def call():
        buffer.copy_(source)
        dist.all_reduce(buffer)
        return buffer

    def refresh():
        source.copy_(torch.randn_like(source))

    def eager_reference():
        out = source.clone()
        dist.all_reduce(out)
        return out

    return call, refresh, eager_reference


def _all_to_all_case(rank, world, device):
    splits = [64 + 8 * ((rank + r) % 3) for r in range(world)]  # rows this rank sends to each peer
    received = [64 + 8 * ((r + rank) % 3) for r in range(world)]  # what each peer sends here
    send = torch.randn(sum(splits), 3, device=device)
    out = torch.empty(sum(received), 3, device=device)

    def call():
        dist.all_to_all_single(out, send, received, splits)
        return out

    def refresh():
        send.copy_(torch.randn_like(send))

    def eager_reference():
        expected = torch.empty_like(out)
        dist.all_to_all_single(expected, send, received, splits)
        return expected

    return call, refresh, eager_reference


CASES = {"system_sum": _system_sum_case, "all_reduce": _all_reduce_case, "all_to_all": _all_to_all_case}


def probe(name, rank, world, device) -> dict:
    call, refresh, eager_reference = CASES[name](rank, world, device)
    row = {"case": name, "ranks": world}
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up outside the capture (NCCL communicators, autograd buffers)
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        worst = 0.0
        for _ in range(5):
            refresh()
            graph.replay()
            torch.cuda.synchronize()
            worst = max(worst, float((captured - eager_reference()).abs().max()))
        row.update({"captured": True, "max diff": worst, "replay ms": _median_ms(graph.replay),
                    "eager ms": _median_ms(call)})
    except Exception as error:  # noqa: BLE001 - a row per case, the others still run
        row.update({"captured": False, "error": f"{type(error).__name__}: {error}"[:300]})
    dist.barrier()
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=".")
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    rows = [probe(name, rank, world, device) for name in args.cases.split(",")]
    if rank == 0:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"nccl_capture_probe_{world}"
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "nccl": ".".join(
            str(v) for v in torch.cuda.nccl.version()), "date": time.strftime("%Y-%m-%d", time.gmtime())}
        stem.with_suffix(".json").write_text(json.dumps({"machine": meta, "rows": rows}, indent=1))
        columns = ["case", "ranks", "captured", "max diff", "replay ms", "eager ms", "error"]
        lines = [f"# NCCL collectives in a CUDA graph, {world} rank(s)", "", f"Machine: {json.dumps(meta)}", "",
                 "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
