"""PME's reciprocal part per call with the Green function kept between calls (NOTE [Green
function cache] in plugins/ewald_pme/mlipdd_ewald_pme/pme.py) and without.

Rattled rock salt (Na+/Cl-, tilted cell), the splitting of an 8 A cutoff at accuracy 1e-4 (or
``--accuracy``; the default mesh from the error estimate), the reciprocal part alone (a 1 A halo: the mesh is what is
timed), energy + forces by autograd, float64, one process, one thread; replicated mesh with the
torch and the Warp splines, and the distributed mesh. Three code states:

* ``before``: the plugin at ``--before`` (a git revision, exported with ``git archive``): the
  Green function built every call, and the mesh convolution's backward computing its gradient
  with respect to the Green function (two FFTs) even when no stress is asked;
* ``cache off``: this tree with ``GREEN_CACHE.enabled = False`` (that backward skipped);
* ``cache on``: this tree as it runs by default.

Seconds are CPU time of the process (``time.process_time``; the 2-core machine is shared with
other jobs, wall time swings with their load), the best of ``--repeats`` calls after a warm-up.
Energies of the three are compared (equal to the last bit between cache off and on).

    python benchmarks/pme_green_cache.py [--sizes 10000,100000] [--before HEAD~1]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUTOFF, ACCURACY = 8.0, 1e-4
MODES = ("replicated", "warp", "distributed")  # reciprocal_only's names: torch splines, Warp splines, slabs


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def worker(sizes, repeats, cache: bool, accuracy: float = ACCURACY, modes=MODES) -> list[dict]:
    """Timings of this interpreter's plugin (whichever tree PYTHONPATH puts first)."""
    import torch
    from mlipdd.neighbors import attach_neighbors
    from mlipdd_ewald_pme import pme
    from mlipdd_ewald_pme.testing import reciprocal_only, rock_salt

    torch.set_num_threads(1)
    if hasattr(pme, "GREEN_CACHE"):
        pme.GREEN_CACHE.enabled = cache
    rows = []
    for size in sizes:
        cells = max(1, round((size / 8) ** (1 / 3)))
        batch = rock_salt((cells, cells, cells), rattle=0.1, seed=0)
        attach_neighbors(batch, 1.0)
        for mode in modes:
            model = reciprocal_only(mode, CUTOFF, accuracy)
            seconds = _time(lambda m=model, b=batch: m(b), repeats)
            cell = batch.cell[0]
            dims = model.mesh_dimensions(batch.cell)[0]
            green = _time(lambda c=cell, d=dims, m=model: pme.green_function(c, d, m.alpha, m.spline_order), repeats)
            rows.append({"atoms": batch.num_atoms, "mode": mode, "mesh": "x".join(map(str, dims)), "s/call": seconds,
                         "green function s": green, "energy": float(model(batch)["energy"][0].detach()),
                         "module": pme.__file__})
    return rows


def _run_tree(tree: pathlib.Path | None, sizes, repeats, cache: bool, accuracy: float) -> list[dict]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree / "core"), str(tree / "plugins/ewald_pme"),
                                             env.get("PYTHONPATH", "")])
    command = [sys.executable, __file__, "--worker", "--sizes", ",".join(map(str, sizes)),
               "--repeats", str(repeats), "--accuracy", str(accuracy), *(["--cache"] if cache else [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=ROOT / "benchmarks")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", default=None, help="git revision of the code before the cache")
    parser.add_argument("--name", default="pme_green_cache")
    parser.add_argument("--accuracy", type=float, default=ACCURACY, help="sets the splitting and the default mesh")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--cache", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        print(json.dumps(worker(sizes, args.repeats, args.cache, args.accuracy, args.modes.split(","))))
        return 0
    from _common import write_results

    states = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            archive = subprocess.run(["git", "archive", args.before, "core", "plugins/ewald_pme"], cwd=ROOT,
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            states["before"] = _run_tree(pathlib.Path(tmp), sizes, args.repeats, False, args.accuracy)
            assert all(tmp in r["module"] for r in states["before"]), "the exported tree was not imported"
        states["cache off"] = _run_tree(None, sizes, args.repeats, False, args.accuracy)
        states["cache on"] = _run_tree(None, sizes, args.repeats, True, args.accuracy)
    rows = []
    for i, on in enumerate(states["cache on"]):
        row = {"atoms": on["atoms"], "mode": on["mode"], "mesh": on["mesh"], "green function s": on["green function s"]}
        for state, results in states.items():
            row[f"{state} s/call"] = results[i]["s/call"]
        first = next(iter(states))
        row["speedup vs " + first] = states[first][i]["s/call"] / on["s/call"]
        row["energy off == on"] = states["cache off"][i]["energy"] == on["energy"]
        if "before" in states:
            row["energy rel. diff vs before"] = abs(states["before"][i]["energy"] - on["energy"]) / abs(on["energy"])
        rows.append(row)
        print(row, flush=True)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    notes = (f"Accuracy {args.accuracy} (mesh from the error estimate), cutoff {CUTOFF} A. "
             f"Reciprocal part only (energy + forces by autograd), float64, order-6 B-splines, one process, one "
             f"thread, CPU seconds, best of {args.repeats} after a warm-up; 'before' = {args.before}. Load average "
             f"at the start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (shared). 'green function s': "
             "building it once (what a cached call saves).")
    print(write_results(args.name, "PME Green function kept between calls: time per reciprocal call", rows, columns,
                        notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
