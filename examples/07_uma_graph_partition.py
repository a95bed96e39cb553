"""UMA under graph partition (and halo): one force call checked against one process, then NVE.

    torchrun --nproc_per_node 2 examples/07_uma_graph_partition.py
    torchrun --nproc_per_node 2 examples/07_uma_graph_partition.py --strategy halo
    python examples/07_uma_graph_partition.py --checkpoint uma.pt --task omat   # one rank

UMA's eSCN-MD backbone builds its radius graph inside forward. Under
``StrategyKind.GRAPH_PARTITION`` every rank sees the full geometry and owns a block of
atoms; the plugin's adapters keep the edges of owned receivers and all-gather node
features once per layer. Under ``StrategyKind.HALO`` each rank gets its subdomain plus
a ghost shell and the backbone builds its graph on those rows (owned receivers only).
Either way the wrapper is the same `UMAWrapper`.

Without ``--checkpoint``/``--pretrained`` a random-weight model is used (no download
needed); float32 throughout.
"""

from __future__ import annotations

import argparse
import sys

import torch
from mlipdd.distributed import (
    DistributedManager,
    DistributedModel,
    DomainConfig,
    DomainParallel,
    gather_rows,
)
from mlipdd.distributed.config import StrategyKind
from mlipdd.dynamics import NVE, ThermoLogger, initialize_velocities
from mlipdd.testing.systems import triclinic


def load_model(args):
    from mlipdd_uma.testing import random_uma
    from mlipdd_uma.wrapper import UMAWrapper

    if args.checkpoint:
        return UMAWrapper.from_checkpoint(args.checkpoint, task=args.task)
    if args.pretrained:
        return UMAWrapper.from_pretrained(args.pretrained, task=args.task)
    return UMAWrapper(random_uma(seed=0), task=args.task)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="graph_partition", choices=["graph_partition", "halo"])
    parser.add_argument("--checkpoint", help="a fairchem inference checkpoint file")
    parser.add_argument("--pretrained", help="a released model name, e.g. uma-s-1p1 (downloads)")
    parser.add_argument("--task", default="omat")
    parser.add_argument("--reps", type=int, default=4, help="grid sites per axis")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    with DistributedManager() as manager:
        model = load_model(args)
        config = DomainConfig(cutoff=model.cutoff, strategy=StrategyKind(args.strategy))
        full = None
        if manager.rank == 0:  # H/C/O on a rattled triclinic grid, float32 (UMA's precision)
            full = triclinic(species=(1, 6, 8), spacing=2.5, reps=args.reps).to(dtype=torch.float32)
            initialize_velocities(full, temperature=300.0, seed=0)

        dm = DistributedModel(model, config)
        owned = dm.partition(full)
        out = dm(owned, compute_stress=True)
        forces = gather_rows(owned.atom_ids, out["forces"])
        print(f"rank {manager.rank}/{manager.world_size} ({args.strategy}): {owned.num_atoms} owned atoms, "
              f"energy {float(out['energy'][0]):.5f} eV")
        if manager.rank == 0:
            reference = model(full.clone(), compute_stress=True)
            df = float((forces - reference["forces"]).abs().max() / reference["forces"].abs().max())
            ds = float((out["stress"] - reference["stress"]).abs().max() / reference["stress"].abs().max())
            print(f"vs one process (float32): relative max |dF| {df:.1e}, |dstress| {ds:.1e}")

        hooks = [ThermoLogger(sys.stdout, frequency=5)]
        with DomainParallel(NVE(model, dt=0.5), config, n_steps=args.steps, hooks=hooks) as dp:
            dp.partition(full)
            dp.run()


if __name__ == "__main__":
    main()
