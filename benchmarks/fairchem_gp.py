"""fairchem's own graph parallelism for the UMA-like eSCN-MD backbone, beside mlipdd's.

    torchrun --standalone --nproc_per_node 2 benchmarks/fairchem_gp.py --check --a2a-sizes 10 --mole-sizes 10 \
        --sizes 10,12,13 --rows uma_rows.jsonl
    torchrun --standalone --nproc_per_node 1 benchmarks/fairchem_gp.py --sizes 10,11      # plain, 1 GPU

What "fairchem's path" is here: the fairchem model (the same random `HydraModelV2` as
`mlipdd_uma.testing.random_uma`, same config and seed) called on fairchem's own input,
``AtomicData.from_ase`` + ``atomicdata_list_to_batch``, on every rank, with fairchem's
graph-parallel groups set up as its predict unit does for several workers
(``gp_utils.setup_graph_parallel_groups(world, backend)`` + ``set_gp_config``). The
backbone then splits the atoms into contiguous blocks, builds the edges of its own block
and all-gathers node features each layer (``mode="allgather"``; ``--mode all_to_all``
sends only the rows a rank needs); fairchem all-reduces energy and forces itself. Its
multi-worker `ParallelMLIPPredictUnit` needs Ray, so it is not used; the model-level
path above is what that unit runs inside each worker. One rank = the plain model, no
graph parallelism.

``--check`` (before the ladder, on a 216-atom periodic triclinic H/C/O cell): the one-process
fairchem result (rank 0, before the GP groups exist), mlipdd's graph partition on the same
ranks, then fairchem's graph parallelism; rows give each one's relative difference to the
one-process result (energy, forces, stress) and fairchem GP's forces against mlipdd's.
Rows are JSON lines shared with `benchmarks/uma_gpu.py` (its ``report`` makes the table).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from uma_gpu import (
    MODEL_LABEL,
    RANK,
    Rows,
    add_ladder_args,
    device_of_rank,
    failure_row,
    ladder_items,
    leave_after_failure,
    model_config,
    parse_sizes,
    peak_gib,
    reset_peak,
    time_steps,
    timing_row,
)

TASK = "omat"


def fairchem_batch(atoms_list, device):
    """fairchem's own input: what its calculator and predict unit build from ase Atoms."""
    from fairchem.core.datasets.atomic_data import AtomicData, atomicdata_list_to_batch

    data = atomicdata_list_to_batch([AtomicData.from_ase(a, task_name=TASK, r_data_keys=["charge", "spin"])
                                     for a in atoms_list])
    return data.to(device)


def run_fairchem(model, data, stress: bool) -> dict:
    """One energy + forces (+ stress) call of the fairchem model on a fresh copy of its input
    (fairchem switches requires_grad on in place)."""
    config = model.backbone.regress_config
    config.forces, config.stress = True, stress
    out = model(data.clone())["energyandforcehead"]
    result = {"energy": out["energy"]["energy"].detach().float(), "forces": out["forces"]["forces"].detach()}
    if stress:
        result["stress"] = out["stress"]["stress"].detach().float().reshape(-1, 3, 3)
    return result


def to_atoms(batch):
    """mlipdd `Batch` of one system -> ase Atoms (positions, numbers, cell, pbc)."""
    from ase import Atoms

    return Atoms(numbers=batch.atomic_numbers.cpu().numpy(), positions=batch.positions.detach().cpu().double().numpy(),
                 cell=batch.cell[0].detach().cpu().double().numpy(), pbc=batch.pbc.reshape(-1, 3)[0].cpu().numpy())


def silicon_atoms(reps):
    from ase.build import bulk
    from mlipdd.lattices import SILICON_LATTICE

    return bulk("Si", "diamond", a=SILICON_LATTICE, cubic=True).repeat(reps)


def setup_gp(world: int, backend: str, mode: str) -> None:
    from fairchem.core.common import gp_utils

    gp_utils.setup_graph_parallel_groups(world, backend)
    set_mode(world, mode)


def set_mode(world: int, mode: str) -> None:
    """fairchem reads the mode at every forward: the groups stay, the exchange changes."""
    from fairchem.core.common import gp_utils

    gp_utils.set_gp_config(gp_utils.GraphParallelConfig(group_size=world, mode=gp_utils.GPMode(mode)))


def modes(args) -> list[str]:
    """The GP modes this launch runs: ``--mode``, and all_to_all first when it has sizes."""
    return (["all_to_all"] if args.a2a_sizes and args.mode != "all_to_all" else []) + [args.mode]


def rel(a, b) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check(args, device, world: int, backend: str, rows: Rows) -> None:
    """One process vs mlipdd's graph partition vs fairchem's graph parallelism, same weights;
    for the dense model and, when the ladder has MoLE sizes, the MoLE model. Leaves fairchem's
    GP groups set up (mlipdd's adapters refuse to run beside them, so mlipdd goes first)."""
    from mlipdd.distributed import DistributedModel, DomainConfig, StrategyKind, gather_rows
    from mlipdd.testing.systems import triclinic
    from mlipdd_uma.testing import random_uma
    from mlipdd_uma.wrapper import UMAWrapper

    batch = triclinic(species=(1, 6, 8), spacing=2.5, reps=6).to(dtype=torch.float32)
    atoms = to_atoms(batch)
    names = sorted({name for name, _ in ladder_items(args)} | {args.config})
    results = {}
    for name in names:
        model = random_uma(model_config(name), seed=0).to(device)
        reference = run_fairchem(model, fairchem_batch([atoms], device), stress=True) if RANK == 0 else None
        # mlipdd's graph partition, the same model object behind UMAWrapper
        dm = DistributedModel(UMAWrapper(model, task=TASK),
                              DomainConfig(cutoff=model.backbone.cutoff, strategy=StrategyKind.GRAPH_PARTITION))
        owned = dm.partition(batch if RANK == 0 else None, device=device)
        ours = dm(owned, compute_stress=True)
        ours["forces"] = gather_rows(owned.atom_ids, ours["forces"])
        results[name] = (model, reference, ours)
        del dm, owned
    setup_gp(world, backend, args.mode)
    for name in names:
        model, reference, ours = results.pop(name)
        common = {"task": "uma_check", "model": MODEL_LABEL[name], "atoms": batch.num_atoms, "gpus": world,
                  "reference": "fairchem, one process", "status": "ok"}
        compared = [("mlipdd_graph_partition", ours, reference, None)]
        for mode in modes(args):
            set_mode(world, mode)
            theirs = run_fairchem(model, fairchem_batch([atoms], device), stress=True)
            compared += [(f"fairchem_gp_{mode}", theirs, reference, None),
                         (f"fairchem_gp_{mode}", theirs, ours, "mlipdd graph partition, same ranks")]
        for path, out, ref, label in compared if RANK == 0 else ():
            rows.emit({**common, "path": path, **({"reference": label} if label else {}),
                       **{f"{k}_rel": rel(out[k], ref[k]) for k in ("energy", "forces", "stress")}})
    set_mode(world, args.mode)
    gc.collect()


def ladder(args, device, world: int, rows: Rows) -> None:
    from mlipdd_uma.testing import random_uma

    items = [(args.mode, name, reps) for name, reps in ladder_items(args)]
    if world > 1 and args.mode != "all_to_all":  # fairchem's other exchange, at sizes that fit
        items = [("all_to_all", args.config, reps) for reps in parse_sizes(args.a2a_sizes)] + items
    built = {}
    for mode, name, reps in items:
        n_atoms = 8 * reps[0] * reps[1] * reps[2]
        path = f"fairchem_gp_{mode}" if world > 1 else "fairchem_plain"
        try:
            if world > 1:
                set_mode(world, mode)
            if name not in built:
                built.clear()
                gc.collect()
                built[name] = random_uma(model_config(name), seed=0).to(device)
            times = _time_size(built[name], reps, args.repeats, device)
            rows.emit(timing_row(path, MODEL_LABEL[name], n_atoms, world, times, peak_gib(device)))
        except Exception as exc:  # noqa: BLE001 - an OOM ends the ladder; anything else too, reported
            rows.emit(failure_row(path, MODEL_LABEL[name], n_atoms, world, exc), any_rank=True)
            # a peer may wait in fairchem's all-gather for this rank forever: leave, torchrun
            # stops it
            leave_after_failure(3)


def _time_size(model, reps, repeats: int, device) -> list[float]:
    """Step times (energy + forces) of one size; its input is freed on return."""
    data = fairchem_batch([silicon_atoms(reps)], device)
    reset_peak(device)
    return time_steps(lambda: run_fairchem(model, data, stress=False), repeats, device)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_ladder_args(p)
    p.add_argument("--check", action="store_true", help="agreement with one process and with mlipdd first")
    p.add_argument("--mode", default="allgather", choices=["allgather", "all_to_all"])
    p.add_argument("--a2a-sizes", default="", help="sizes run first in mode all_to_all (dense model)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = Rows(args.rows)
    device = device_of_rank()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world > 1 or args.check:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        if args.check:
            check(args, device, world, backend, rows)
        elif world > 1:
            setup_gp(world, backend, args.mode)
        ladder(args, device, world, rows)
    except Exception as exc:  # noqa: BLE001 - say which rank failed, then leave without waiting
        print(f"rank {RANK}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        rows.emit({"task": "uma_check", "path": f"fairchem_gp_{args.mode}", "model": MODEL_LABEL[args.config],
                   "gpus": world, "status": f"error: {type(exc).__name__}: {exc}"[:300], "rank": RANK}, any_rank=True)
        leave_after_failure(4)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
