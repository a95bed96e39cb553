"""AIMNet2 at one process: `AIMNet2Wrapper` next to aimnet's own `AIMNet2Calculator`, CPU.

    python benchmarks/aimnet2_vs_calculator.py [--reps "5,4,3;7,7,7;10,10,10;12,12,12"] [--repeats 3]
    python benchmarks/aimnet2_vs_calculator.py --profile 7,7,7      # where one call's time goes

The same random-weight AIMNet2 (released architecture, 2.2 M parameters), float32, DSF
Coulomb (aimnet's periodic default: alpha 0.2, 15 A), energy + forces per call, on a
triclinic crystal of methanol-like molecules. Three timings per size:

* ``aimnet_s``: ``calc(data, forces=True)``, which builds its neighbour matrices every call;
* ``mlipdd_call_s``: ``model(batch)`` on a batch without a list (the wrapper builds one,
  as the calculator does);
* ``mlipdd_step_s``: ``model(batch)`` with the list attached, as in dynamics, where a
  list built with a skin serves several steps.

Times are the process's CPU seconds (``time.process_time``, one intra-op thread): on a
machine shared with other jobs wall time swings 2x with their load, CPU time does not
(much). The calls alternate (aimnet, mlipdd, aimnet, ...) and each timing is the best of
``--repeats``. ``--profile`` times the stages of one call of each (best per stage).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from _common import markdown_table, write_results


def _setup(reps, dsf_cutoff):
    from aimnet.calculators import AIMNet2Calculator
    from mlipdd.data import Batch
    from mlipdd_aimnet2.building import random_aimnet2
    from mlipdd_aimnet2.testing import molecular_crystal
    from mlipdd_aimnet2.wrapper import AIMNet2Wrapper

    model, _ = random_aimnet2(seed=0, dtype=torch.float32)
    crystal = molecular_crystal(reps, seed=0, dtype=torch.float32)
    wrapper = AIMNet2Wrapper(model, dispersion=False, coulomb="dsf", dsf_cutoff=dsf_cutoff)
    calc = AIMNet2Calculator(model, needs_coulomb=True, needs_dispersion=False, device="cpu")
    calc.set_lrcoulomb_method("dsf", cutoff=dsf_cutoff, dsf_alpha=0.2)
    data = {"coord": crystal.positions, "numbers": crystal.atomic_numbers, "charge": torch.tensor([0.0]),
            "cell": crystal.cell[0], "pbc": torch.ones(3, dtype=torch.bool)}
    return wrapper, calc, data, Batch.from_data_list([crystal])


def _best(calls: dict, repeats: int) -> dict:
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.process_time()
            call()
            best[name] = min(best[name], time.process_time() - start)
    return best


def compare(reps, dsf_cutoff, repeats) -> dict:
    from mlipdd.neighbors import attach_neighbors

    wrapper, calc, data, batch = _setup(reps, dsf_cutoff)
    listed = batch.clone()
    attach_neighbors(listed, wrapper.cutoff)
    ours, theirs = wrapper(batch), calc(data, forces=True)  # warm-up (and the agreement check)
    wrapper(listed)
    best = _best({"aimnet_s": lambda: calc(data, forces=True), "mlipdd_call_s": lambda: wrapper(batch),
                  "mlipdd_step_s": lambda: wrapper(listed)}, repeats)
    energy = float(ours["energy"].sum())
    return {"atoms": batch.num_atoms, "pairs_in_15A": listed.neighbors.num_edges, **best,
            "aimnet_over_mlipdd_call": best["aimnet_s"] / best["mlipdd_call_s"],
            "aimnet_over_mlipdd_step": best["aimnet_s"] / best["mlipdd_step_s"],
            "energy_diff_eV": abs(energy - float(theirs["energy"].sum())),
            "force_diff_max": float((ours["forces"] - theirs["forces"]).abs().max())}


class _Stages:
    """Wall time per named function, summed over one call (monkeypatched wrappers)."""

    def __init__(self):
        self.times, self._undo = {}, []

    def wrap(self, owner, attribute, name):
        original = getattr(owner, attribute, None)
        if original is None:  # an older version of the plugin has no such stage
            return

        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.times[name] = self.times.get(name, 0.0) + time.process_time() - start

        setattr(owner, attribute, timed)
        self._undo.append((owner, attribute, original))

    def undo(self):
        for owner, attribute, original in reversed(self._undo):
            setattr(owner, attribute, original)
        self._undo.clear()


def profile(reps, dsf_cutoff, repeats) -> list[dict]:
    import mlipdd.neighbors
    import mlipdd_aimnet2.wrapper as wrapper_module
    from mlipdd_aimnet2 import inputs

    wrapper, calc, data, batch = _setup(reps, dsf_cutoff)
    rows = []
    for who, call in (("mlipdd", lambda: wrapper(batch)), ("aimnet", lambda: calc(data, forces=True))):
        call()
        best: dict[str, float] = {}
        for _ in range(repeats):
            stages = _Stages()
            if who == "mlipdd":
                stages.wrap(wrapper_module, "aimnet_kernel_matrices", "neighbour matrices (nvalchemiops, both lists)")
                stages.wrap(wrapper_module, "aimnet_kernel_neighbors", "neighbour list (nvalchemiops)")
                stages.wrap(mlipdd.neighbors, "attach_neighbors", "neighbour list (vesin + sort)")
                stages.wrap(inputs, "edge_lengths", "input matrices: edge lengths")
                stages.wrap(inputs, "neighbor_matrix", "input matrices: COO -> matrices")
                stages.wrap(wrapper_module, "aimnet_inputs", "input matrices (all)")
                stages.wrap(wrapper_module, "dsf_energy", "DSF Coulomb (torch, autograd)")
                stages.wrap(wrapper_module, "dsf_energy_and_forces", "DSF Coulomb (nvalchemiops kernel + forces)")
            else:
                stages.wrap(calc, "prepare_input", "neighbour matrices (nvalchemiops, both lists)")
                stages.wrap(calc, "_run_external_modules", "DSF Coulomb (nvalchemiops kernel + forces)")
            stages.wrap(wrapper.model, "forward_prepared", "network forward")
            stages.wrap(torch.autograd, "grad", "backward (forces)")
            start = time.process_time()
            call()
            stages.times["whole call"] = time.process_time() - start
            stages.undo()
            for name, seconds in stages.times.items():
                best[name] = min(best.get(name, float("inf")), seconds)
        rows += [{"code": who, "stage": name, "best_s": seconds, "share": seconds / best["whole call"]}
                 for name, seconds in best.items()]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", default="5,4,3;7,7,7;10,10,10;12,12,12", help="unit cells per axis, ';' between sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dsf-cutoff", type=float, default=15.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", default=None, help="reps of one size: time the stages instead")
    p.add_argument("--label", default="", help="added to each row (e.g. the commit measured)")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    common = (f"Random-weight AIMNet2 (released architecture), float32, DSF alpha 0.2 / {args.dsf_cutoff} A, "
              f"energy + forces, {args.threads} intra-op thread(s), one process. Seconds are CPU time of the "
              f"process, best of {args.repeats} alternating calls. Load average at start {load:.1f} on "
              f"{os.cpu_count()} cores (a machine shared with other jobs).")
    if args.profile:
        reps = tuple(int(r) for r in args.profile.split(","))
        rows = profile(reps, args.dsf_cutoff, args.repeats)
        for row in rows:
            row["label"] = args.label
        atoms = 6 * reps[0] * reps[1] * reps[2]
        table = write_results(args.name or "aimnet2_profile", f"AIMNet2 one call, {atoms} atoms: where the time goes",
                              rows, ["label", "code", "stage", "best_s", "share"], common)
        print(table)
        return 0
    rows = []
    for text in args.reps.split(";"):
        row = {"label": args.label, **compare(tuple(int(r) for r in text.split(",")), args.dsf_cutoff, args.repeats)}
        rows.append(row)
        print(row, flush=True)
    columns = ["label", "atoms", "pairs_in_15A", "aimnet_s", "mlipdd_call_s", "mlipdd_step_s",
               "aimnet_over_mlipdd_call", "aimnet_over_mlipdd_step", "energy_diff_eV", "force_diff_max"]
    if args.name is None:
        print(markdown_table(rows, columns))
        return 0
    print(write_results(args.name, "AIMNet2 at one process: mlipdd vs aimnet's calculator (CPU)", rows, columns,
                        common))
    return 0


if __name__ == "__main__":
    sys.exit(main())
