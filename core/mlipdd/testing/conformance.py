"""Single process vs spawned ranks: the checks every model plugin runs on its own model.

``check_conformance(model_factory, batch, world_size)`` computes the reference in this
process, runs `DistributedModel` on ``world_size`` spawned gloo ranks, puts the owned
forces back in global atom order and compares energy, forces and stress.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mlipdd.data import Batch
from mlipdd.testing.spawn import run_ranks


@dataclass
class ConformanceResult:
    world_size: int
    reference: dict
    distributed: dict
    rel_diff: dict = field(default_factory=dict)
    abs_diff: dict = field(default_factory=dict)

    def assert_close(self, energy: float = 1e-12, forces: float = 1e-10, stress: float = 1e-10) -> None:
        limits = {"energy": energy, "forces": forces, "stress": stress}
        bad = {k: v for k, v in self.rel_diff.items() if k in limits and not v <= limits[k]}
        assert not bad, f"{self.world_size} ranks differ from one process: {bad} (limits {limits})"


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = max(float(b.abs().max()), 1e-300) if b.numel() else 1.0
    return float((a - b).abs().max()) / scale if a.numel() else 0.0


def build_model(model_factory: Callable, device="cpu"):
    """``model_factory()`` on ``device``; a raw model (e.g. a mace module) is wrapped through
    the plugin system first, as `DistributedModel` and `trace_and_validate` do."""
    model = model_factory()
    if not hasattr(model, "model_config"):
        from mlipdd.plugins import wrap_model

        model = wrap_model(model)
    return model.to(device)


def distributed_outputs(rank, world_size, model_factory, batch, config_kwargs, compute_stress, spec=None,
                        device="cpu"):
    """Worker: partition ``batch`` from rank 0, one distributed forward, owned results."""
    from mlipdd.distributed import DistributedModel, DomainConfig

    model = build_model(model_factory, device)
    config = DomainConfig(**{"cutoff": model.cutoff, **config_kwargs})
    dm = DistributedModel(model, config, spec=spec)
    owned = dm.partition(batch if rank == 0 else None, device=device)
    out = dm(owned, compute_stress=compute_stress)
    report = dm.strategy.report()  # through the protocol: any strategy, a third party's too
    return {
        "atom_ids": owned.atom_ids,
        "energy": out["energy"],
        "forces": out["forces"],
        "stress": out.get("stress"),
        "grid": report["grid"],
        "n_ghost": report["ghost_rows"],
    }


def gather_by_id(parts: list[dict], key: str, n_atoms: int) -> torch.Tensor:
    first = parts[0][key]
    out = first.new_full((n_atoms, *first.shape[1:]), float("nan"))
    for p in parts:
        out[p["atom_ids"]] = p[key]
    return out


def check_conformance(model_factory: Callable, batch: Batch, world_size: int, compute_stress: bool = True,
                      config_kwargs: dict | None = None, spec=None, timeout: float = 300.0,
                      device: str = "cpu", backend: str = "gloo") -> ConformanceResult:
    """``device="cuda"`` runs the reference and every rank on the GPU (ranks share it over gloo)."""
    model = build_model(model_factory, device)
    reference = model(batch.clone().to(device), compute_stress=compute_stress)
    reference = {k: v.detach().cpu() for k, v in reference.items() if torch.is_tensor(v)}
    parts = run_ranks(distributed_outputs, world_size, model_factory, batch, config_kwargs or {},
                      compute_stress, spec, device, timeout=timeout, backend=backend)
    ids = torch.cat([p["atom_ids"] for p in parts])
    assert torch.equal(ids.sort().values, batch.atom_ids.sort().values), "atoms lost or duplicated"
    dist_out = {"energy": parts[0]["energy"], "forces": gather_by_id(parts, "forces", batch.num_atoms)}
    if compute_stress:
        dist_out["stress"] = parts[0]["stress"]
    for p in parts[1:]:  # replicated outputs must agree bit-for-bit-ish across ranks
        assert relative_difference(p["energy"], dist_out["energy"]) < 1e-14
    result = ConformanceResult(world_size, reference, dist_out)
    for key, value in dist_out.items():
        result.rel_diff[key] = relative_difference(value, reference[key])
        result.abs_diff[key] = float((value - reference[key]).abs().max())
    return result


class _BuiltOnce:
    """One model per factory object (the same factory in several cases is built once).

    NOTE [one model for several cases]: a wrapper is single-process code that
    `DistributedModel` wraps without changing it (a spec's adapters are installed around
    each call only), so a model serves every case of its factory, as one model serves
    every call of an MD run. Building is the slow part of a case for real models: a cuEq
    MACE conversion takes 3-7 s of the 2-core machine, its forward on a small system 0.1 s.
    """

    def __init__(self, device):
        self.device, self.models = device, {}

    def __call__(self, factory):
        key = id(factory)  # the cases list holds the factory, so the id stays its own
        if key not in self.models:
            self.models[key] = build_model(factory, self.device)
        return self.models[key]


def _distributed_cases(rank, world_size, cases, compute_stress, device):
    """Worker: `distributed_outputs` for several (model_factory, batch, config_kwargs) in one launch,
    plus the strategy's rank grid (its cut planes) and owned-atom imbalance."""
    out = []
    model_of = _BuiltOnce(device)
    for factory, batch, config_kwargs in cases:
        from mlipdd.distributed import DistributedModel, DomainConfig

        model = model_of(factory)
        dm = DistributedModel(model, DomainConfig(**{"cutoff": model.cutoff, **config_kwargs}))
        owned = dm.partition(batch if rank == 0 else None, device=device)
        result = dm(owned, compute_stress=compute_stress)
        out.append({
            "atom_ids": owned.atom_ids, "energy": result["energy"], "forces": result["forces"],
            "stress": result.get("stress"), "grid": dm.strategy.grid,
            "imbalance": dm.strategy.report()["load_imbalance"],
        })
    return out


def check_conformance_cases(cases, world_size: int, compute_stress: bool = True, timeout: float = 300.0,
                            device: str = "cpu") -> list[tuple[ConformanceResult, list[dict]]]:
    """`check_conformance` for several ``(model_factory, batch, config_kwargs)`` cases in ONE
    spawned launch (starting ranks costs more than a small system's forward); cases that share
    a factory object share its model (NOTE [one model for several cases]). Returns per
    case the result and every rank's raw part (``grid``, ``imbalance``, ``atom_ids``)."""
    per_rank = run_ranks(_distributed_cases, world_size, cases, compute_stress, device, timeout=timeout)
    checked = []
    model_of = _BuiltOnce(device)
    for i, (factory, batch, _) in enumerate(cases):
        model = model_of(factory)
        reference = model(batch.clone().to(device), compute_stress=compute_stress)
        reference = {k: v.detach().cpu() for k, v in reference.items() if torch.is_tensor(v)}
        parts = [p[i] for p in per_rank]
        ids = torch.cat([p["atom_ids"] for p in parts])
        assert torch.equal(ids.sort().values, batch.atom_ids.sort().values), "atoms lost or duplicated"
        dist_out = {"energy": parts[0]["energy"], "forces": gather_by_id(parts, "forces", batch.num_atoms)}
        if compute_stress:
            dist_out["stress"] = parts[0]["stress"]
        result = ConformanceResult(world_size, reference, dist_out)
        for key, value in dist_out.items():
            result.rel_diff[key] = relative_difference(value, reference[key])
            result.abs_diff[key] = float((value - reference[key]).abs().max())
        checked.append((result, parts))
    return checked


def cases_off(cases, names, world_size: int, tolerance: float = 1e-10) -> dict:
    """``{name: {output: relative difference}}`` of the cases (`check_conformance_cases`, one
    launch) whose energy, forces or stress differ from one process by more than ``tolerance``."""
    bad = {}
    for (result, _), name in zip(check_conformance_cases(cases, world_size), names):
        off = {k: v for k, v in result.rel_diff.items() if not v <= tolerance}
        if off:
            bad[name] = off
    return bad
