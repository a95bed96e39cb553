"""UMA-like eSCN-MD on 1 and N GPUs: mlipdd's graph partition, stepped up in size until the
GPU runs out of memory, and the report that sets these rows beside fairchem's own
graph-parallel path (`benchmarks/fairchem_gp.py`, which shares the helpers below).

    torchrun --standalone --nproc_per_node 2 benchmarks/uma_gpu.py ladder \\
        --sizes 10,12,13,14 --mole-sizes 10 --rows $OUT/uma_rows.jsonl
    python benchmarks/uma_gpu.py report --rows uma_rows.jsonl --machine "2x H200 ..."

A size is diamond-silicon cubic cells per axis, ``12`` or ``11x11x12`` (8 atoms a cell).
Sizes run in the order given, in ONE launch, and the launch ends at the first failure:
an out-of-memory error tears mlipdd's process group down on every rank (fail-together),
and under fairchem's own path a rank left waiting in a collective would hang, so the
failing rank leaves and torchrun stops the others. So give sizes in ascending order:
the last "ok" row is the largest system that fits, the failing one the first that does not.
Models: random weights, float32, energy + forces per step (no stress), `uma_bench_config`
(eSCN-MD 128 channels, lmax 2, 4 layers, 6 A) and, with ``--mole-sizes``, the same with
UMA-S's 32-expert MoLE (`uma_s_mole_config`; run first, at sizes that fit).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch
import torch.distributed as dist

HERE = pathlib.Path(__file__).resolve().parent
# benchmarks/mace.py is named like the `mace` package: keep this folder behind site-packages.
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != HERE] + [str(HERE)]
RESULTS = HERE / "results"
RANK = int(os.environ.get("RANK", "0"))  # known even after a failure tore the group down


# ---- shared with fairchem_gp.py -------------------------------------------------------------
def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    """``"10,11x11x12"`` -> [(10, 10, 10), (11, 11, 12)] (cells per axis)."""
    sizes = []
    for item in filter(None, text.split(",")):
        parts = [int(p) for p in item.lower().split("x")]
        sizes.append(tuple(parts * 3) if len(parts) == 1 else tuple(parts))
    return sizes


def model_config(name: str) -> dict:
    from mlipdd_uma.testing import tiny_uma_config, uma_bench_config, uma_s_mole_config

    return {"bench": uma_bench_config, "mole": uma_s_mole_config, "tiny": tiny_uma_config,
            "tiny_mole": lambda: {**tiny_uma_config(), **_mole(4)}}[name]()


def _mole(n: int) -> dict:
    from mlipdd_uma.testing import mole_settings

    return mole_settings(n)


MODEL_LABEL = {"bench": "uma_bench_f32", "mole": "uma_s_mole_f32", "tiny": "uma_tiny_f32",
               "tiny_mole": "uma_tiny_mole_f32"}


def device_of_rank() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """Peak allocated GiB on this rank's GPU since `reset_peak`, max over ranks (None on CPU)."""
    if device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def time_steps(step, repeats: int, device: torch.device) -> list[float]:
    """One warm-up call, then ``repeats`` timed calls between barriers (slowest rank sets it)."""
    step()
    times = []
    for _ in range(repeats):
        synchronize(device)
        barrier()
        t = time.perf_counter()
        step()
        synchronize(device)
        barrier()
        times.append(time.perf_counter() - t)
    return times


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA OOM here, or a peer's (mlipdd re-raises it on the others as RemoteRankError)."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


class Rows:
    """JSON lines, appended by rank 0 (or by any rank that reports its own failure)."""

    def __init__(self, path: str | None):
        self.path = pathlib.Path(path) if path else RESULTS / "uma_gpu_rows.jsonl"

    def emit(self, row: dict, any_rank: bool = False) -> None:
        if RANK != 0 and not any_rank:
            return
        row = {**row, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


def timing_row(path: str, model: str, n_atoms: int, gpus: int, times: list[float], peak) -> dict:
    step = statistics.median(times)
    return {"task": "uma_ladder", "path": path, "model": model, "atoms": n_atoms, "gpus": gpus,
            "step_s": step, "atom_steps_per_s": n_atoms / step, "peak_GiB_per_gpu": peak, "status": "ok"}


def failure_row(path: str, model: str, n_atoms: int, gpus: int, exc: BaseException) -> dict:
    status = "out of memory" if is_out_of_memory(exc) else f"error: {type(exc).__name__}: {exc}"[:300]
    return {"task": "uma_ladder", "path": path, "model": model, "atoms": n_atoms, "gpus": gpus,
            "step_s": None, "atom_steps_per_s": None, "peak_GiB_per_gpu": None, "status": status,
            "rank": RANK}


def ladder_items(args) -> list[tuple[str, tuple[int, int, int]]]:
    """(model name, cells per axis): the MoLE sizes first (they should fit), then the ladder."""
    mole = "tiny_mole" if args.config == "tiny" else "mole"
    return ([(mole, s) for s in parse_sizes(args.mole_sizes)]
            + [(args.config, s) for s in parse_sizes(args.sizes)])


def leave_after_failure(code: int = 0) -> None:
    """The group may be aborted (mlipdd) or a peer stuck in a collective (fairchem): do not
    clean up, leave; torchrun stops the peers if they are still running."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- mlipdd ladder ---------------------------------------------------------------------------
def mlipdd_ladder(args) -> None:
    from mlipdd.distributed import DistributedManager
    from mlipdd_uma.testing import random_uma_wrapper

    rows = Rows(args.rows)
    mgr = DistributedManager()
    path = f"mlipdd_{args.strategy}"
    built = {}
    for name, reps in ladder_items(args):
        n_atoms = 8 * reps[0] * reps[1] * reps[2]
        try:
            if name not in built:
                built.clear()
                gc.collect()
                built[name] = random_uma_wrapper(model_config(name), seed=0).to(mgr.device).eval()
            times = _mlipdd_size(built[name], reps, args, mgr)
            rows.emit(timing_row(path, MODEL_LABEL[name], n_atoms, mgr.world_size, times, peak_gib(mgr.device)))
        except Exception as exc:  # noqa: BLE001 - an OOM ends the ladder; anything else too, reported
            rows.emit(failure_row(path, MODEL_LABEL[name], n_atoms, mgr.world_size, exc), any_rank=True)
            leave_after_failure()
    mgr.cleanup()


def _mlipdd_size(model, reps, args, mgr) -> list[float]:
    """Step times of one size; the partitioned system is freed on return."""
    from mlipdd.distributed import DistributedModel, DomainConfig, StrategyKind
    from mlipdd.lattices import silicon_diamond

    full = silicon_diamond(reps, dtype=torch.float32) if mgr.rank == 0 else None
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.5, strategy=StrategyKind(args.strategy)))
    owned = dm.partition(full, device=mgr.device)
    del full
    reset_peak(mgr.device)
    return time_steps(lambda: dm(owned), args.repeats, mgr.device)


# ---- report ----------------------------------------------------------------------------------
def report(args) -> None:
    from _common import markdown_table

    rows = []
    for path in args.rows_files:
        rows += [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
    checks = [r for r in rows if r["task"] == "uma_check"]
    why = {0: "", 124: " (stopped by its timeout: later sizes not tried)"}
    launches = [f"{r['name']}: exit {r['exit']}" + why.get(r["exit"], " (a rank failed and left; its row says why)")
                for r in rows if r["task"] == "launch"]
    runs = {}  # one row per run: every failing rank may have reported; a peer's view of the
    for r in rows:  # failure (a closed connection) yields to the rank that ran out of memory
        key = (r.get("path"), r.get("model"), r.get("atoms"), r.get("gpus"))
        if r["task"] == "uma_ladder" and (key not in runs or r["status"] == "out of memory"):
            runs[key] = r
    ladder = list(runs.values())
    one_gpu = {}  # the 1-GPU step of the same model and size: fairchem's plain model, else mlipdd's
    for path in ("mlipdd_graph_partition", "fairchem_plain"):
        one_gpu.update({(r["model"], r["atoms"]): r["step_s"] for r in ladder
                        if r["gpus"] == 1 and r["status"] == "ok" and r["path"] == path})
    for r in ladder:
        if r["status"] == "ok" and (r["model"], r["atoms"]) in one_gpu:
            r["speedup"] = one_gpu[(r["model"], r["atoms"])] / r["step_s"]
    for group in {(r["path"], r["model"], r["gpus"]) for r in ladder}:
        runs = [r for r in ladder if (r["path"], r["model"], r["gpus"]) == group]
        fits = [r["atoms"] for r in runs if r["status"] == "ok"]
        fails = [r["atoms"] for r in runs if r["status"] != "ok"]
        for r in runs:
            if fits and r["atoms"] == max(fits):
                r["largest"] = "largest" + (f" (next: {min(fails)} {_short(runs, min(fails))})" if fails else
                                            " (no size failed)")
    ladder.sort(key=lambda r: (r["model"], r["atoms"], r["gpus"], r["path"]))
    text = ["# UMA-like eSCN-MD on GPUs: mlipdd graph partition vs fairchem's graph parallelism", "",
            args.machine, "",
            ("Random weights, float32, energy + forces per step, diamond silicon (8 atoms per cubic cell), "
            "6 A cutoff. uma_bench_f32: eSCN-MD 128 channels, lmax 2, 4 layers, no MoLE; uma_s_mole_f32: "
            "the same with UMA-S's 32-expert MoLE routed by composition. Paths: fairchem_plain = the "
            "fairchem model on one GPU (no graph parallelism); fairchem_gp_<mode> = fairchem's own graph "
            "parallelism (gp_utils groups, one rank per GPU); mlipdd_graph_partition = mlipdd's strategy "
            "(one rank per GPU; 1 GPU = one rank). speedup: the 1-GPU step (fairchem_plain, where it "
            "ran, else mlipdd's one rank) over this step, same model and size. peak_GiB_per_gpu: torch's peak allocated memory, max over ranks. "
            "largest: the largest size of that path that ran; next = the first size that failed. "
            "Sizes run in ascending order in one launch per path, which ends at the first failure."), "",
            *(["Launches: " + "; ".join(launches) + ".", ""] if launches else []),
            "## Step time and memory", "",
            markdown_table(ladder, ["atoms", "gpus", "path", "model", "step_s", "speedup", "peak_GiB_per_gpu",
                                    "largest", "status"]),
            "## Agreement (same weights, same system)", "",
            markdown_table(checks, ["path", "model", "atoms", "gpus", "reference", "energy_rel", "forces_rel",
                                    "stress_rel", "status"]), ""]
    out = pathlib.Path(args.output) if args.output else RESULTS / "uma_gpu.md"
    out.write_text("\n".join(text) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"machine": args.machine, "ladder": ladder, "checks": checks},
                                                   indent=1))
    print("\n".join(text))


def _short(runs, atoms) -> str:
    status = next(r["status"] for r in runs if r["atoms"] == atoms)
    return "OOM" if status == "out of memory" else status[:60]


def add_ladder_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="10,12", help="cells per axis, ascending: '10,11x11x12,12'")
    p.add_argument("--mole-sizes", default="", help="sizes for the MoLE model, run first")
    p.add_argument("--config", default="bench", choices=["bench", "tiny"], help="tiny: CPU smoke runs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default=None, help="JSON-lines file (default benchmarks/results/uma_gpu_rows.jsonl)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="task", required=True)
    lad = sub.add_parser("ladder", help="mlipdd, one rank per GPU (torchrun)")
    add_ladder_args(lad)
    lad.add_argument("--strategy", default="graph_partition", choices=["graph_partition", "halo"])
    rep = sub.add_parser("report", help="markdown table from the rows of both scripts")
    rep.add_argument("rows_files", nargs="+")
    rep.add_argument("--machine", default="")
    rep.add_argument("--output", default=None, help="default benchmarks/results/uma_gpu.md")
    args = p.parse_args()
    (mlipdd_ladder if args.task == "ladder" else report)(args)


if __name__ == "__main__":
    main()
