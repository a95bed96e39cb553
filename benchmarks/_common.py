"""Shared helpers of the benchmark runners: timing, machine description, result files."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or what the platform module knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict:
    cpu = cpu_model()
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def median_time(fn, repeats: int = 5, warmup: int = 1, sync=None) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    body = "".join("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |\n" for r in rows)
    return head + body


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_results(name: str, title: str, rows: list[dict], columns: list[str], notes: str = "",
                  out_dir: Path = RESULTS) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    table = markdown_table(rows, columns)
    text = f"# {title}\n\nMachine: {json.dumps(info)}\n\n{table}\n{notes}\n"
    (out_dir / f"{name}.md").write_text(text)
    (out_dir / f"{name}.json").write_text(json.dumps({"machine": info, "rows": rows, "notes": notes}, indent=1))
    return table


def _status_mb(key: str) -> float:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024


def peak_and_wall(call, repeats: int, world_size: int) -> dict:
    """CPU rank: peak extra resident memory of one ``call`` (VmHWM reset first, Linux) and
    wall times of ``repeats`` more, each between barriers so the slowest rank sets it."""
    import gc

    import torch.distributed as dist

    call()  # warm-up (and the neighbour list)
    gc.collect()
    before = _status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    out = call()
    peak = _status_mb("VmHWM") - before
    del out
    wall = []
    for _ in range(repeats):
        if world_size > 1:
            dist.barrier()
        t = time.perf_counter()
        call()
        if world_size > 1:
            dist.barrier()
        wall.append(time.perf_counter() - t)
    return {"best_s": min(wall), "median_s": statistics.median(wall), "peak_mb": peak}


def torchpme_step(batch, cutoff: float, alpha: float, mesh_spacing: float):
    """torch-pme's energy + forces of ``batch`` (one periodic system, its charges) as a
    callable: the outside reference the PME runners time next to mlipdd's PMEWrapper at the
    same Ewald splitting (``alpha``) and mesh spacing; returns the energy (eV)."""
    import math

    import torch
    import torchpme
    from torchpme.prefactors import eV_A
    from vesin_torch import NeighborList

    cell = batch.cell[0]
    pairs, shifts = NeighborList(cutoff=cutoff, full_list=False).compute(
        points=batch.positions, box=cell, periodic=True, quantities="PS")
    potential = torchpme.CoulombPotential(smearing=1.0 / (math.sqrt(2.0) * alpha)).to(
        device=batch.positions.device, dtype=batch.positions.dtype)
    calc = torchpme.PMECalculator(potential, mesh_spacing=mesh_spacing, interpolation_nodes=4).to(
        batch.positions.device)
    q = batch.charges.unsqueeze(1)

    def step():
        positions = batch.positions.detach().requires_grad_(True)
        d = (positions[pairs[:, 1]] + shifts.to(positions.dtype) @ cell - positions[pairs[:, 0]]).norm(dim=1)
        energy = eV_A * (q * calc(q, cell, positions, pairs, d)).sum()
        torch.autograd.grad(energy, positions)
        return energy

    return step
