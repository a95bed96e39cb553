"""Does PME deliver the accuracy it is asked for? RMS force error at the default mesh.

For each system of the committed set (`mlipdd_ewald_pme.testing.accuracy_systems`: NaCl
crystal, SPC/E water in a sheared cell, a NaCl slab with vacuum, a charged cell; plus MgO
with formal +-2 charges, for scale) and each requested accuracy, `PMEWrapper(cutoff=7,
accuracy=...)` at its DEFAULT mesh is compared with Ewald at the same alpha and real-space
cutoff and a converged k-space (accuracy 1e-14 for the k-cutoff): the difference is PME's
reciprocal (mesh) error alone. Next to it: the mesh's error estimate (NOTE [PME error
estimate] in pme.py, exact alias sum), the old default mesh (just resolving Ewald's
k-cutoff), Ewald's own k-space error at that accuracy and its Kolafa-Perram estimate, and
the total error of PME against a fully converged Coulomb sum (14 A real space, 1e-14).

Pass criterion (exit code 1 if not met): on the four committed systems at accuracy
1e-4 .. 1e-8, the RMS force error of PME against the converged Ewald is within 3x the
requested accuracy (in eV/A); below 1e-6 the default spreads with the plain-torch spline
ops. A second table shows the floor that nvalchemiops' spline kernels set (they skip
stencil weights below 1e-8) by refining the mesh at accuracy 1e-9, Warp against torch.

    python benchmarks/ewald_pme_accuracy.py            # writes results/ewald_pme_accuracy.{md,json}
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from _common import write_results

CUTOFF = 7.0
ACCURACIES = (1e-4, 1e-5, 1e-6, 1e-7, 1e-8)


def _rms(a, b) -> float:
    return float((a - b).square().sum(1).mean().sqrt())


def _forces(model, batch):
    out = model(batch)
    return out["forces"].detach(), float(out["energy"][0].detach())


def _old_default(accuracy):
    """PMEWrapper with the previous default mesh (Nyquist of the Ewald k-cutoff)."""
    from mlipdd_ewald_pme import pme
    from mlipdd_ewald_pme.wrappers import PMEWrapper

    class NyquistPME(PMEWrapper):
        def mesh_dimensions(self, cell):
            return [pme.mesh_dimensions(c, self.k_cutoff, self.spline_order, None) for c in cell]

    return NyquistPME(cutoff=CUTOFF, accuracy=accuracy)


def accuracy_rows(systems, accuracies):
    from mlipdd_ewald_pme import pme
    from mlipdd_ewald_pme.wrappers import EwaldWrapper, PMEWrapper

    rows = []
    for name, batch in systems.items():
        exact, _ = _forces(EwaldWrapper(cutoff=14.0, accuracy=1e-14), batch)
        cell, volume, q = batch.cell[0], float(batch.cell[0].det().abs()), batch.charges
        for accuracy in accuracies:
            model = PMEWrapper(cutoff=CUTOFF, accuracy=accuracy)
            dims = model.mesh_dimensions(batch.cell)[0]
            converged, converged_energy = _forces(EwaldWrapper(cutoff=CUTOFF, accuracy=1e-14, alpha=model.alpha), batch)
            ewald, _ = _forces(EwaldWrapper(cutoff=CUTOFF, accuracy=accuracy), batch)
            forces, energy = _forces(model, batch)
            start = time.perf_counter()
            _forces(model, batch)
            seconds = time.perf_counter() - start
            old, _ = _forces(_old_default(accuracy), batch)
            estimate = pme.rms_force_error(pme.mesh_error_functional(cell, dims, model.alpha, model.spline_order),
                                           q, volume)
            kolafa_perram = pme.rms_force_error(pme.ewald_error_functional(model.alpha, model.k_cutoff), q, volume)
            error = _rms(forces, converged)
            rows.append({
                "system": name, "accuracy": accuracy, "spline": model.spline, "mesh": "x".join(map(str, dims)),
                "spacing A": max(float(length) / n for length, n in zip(cell.norm(dim=1), dims)),
                "PME err eV/A": error, "err / accuracy": error / accuracy, "estimate eV/A": estimate,
                "old mesh err": _rms(old, converged), "Ewald k err": _rms(ewald, converged),
                "K-P estimate": kolafa_perram, "PME total err": _rms(forces, exact),
                "dE/atom eV": abs(energy - converged_energy) / batch.num_atoms, "PME s": seconds,
            })
            print(rows[-1], flush=True)
    return rows


def floor_rows(batch, accuracy=1e-9, spacings=(0.3, 0.2, 0.15, 0.12, 0.09)):
    from mlipdd_ewald_pme import pme
    from mlipdd_ewald_pme.wrappers import EwaldWrapper, PMEWrapper

    rows = []
    reference = None
    for spline, spacing in [(s, h) for s in ("warp", "torch") for h in spacings]:
        model = PMEWrapper(cutoff=CUTOFF, accuracy=accuracy, mesh_spacing=spacing, spline=spline)
        if reference is None:
            reference = _forces(EwaldWrapper(cutoff=CUTOFF, accuracy=1e-14, alpha=model.alpha), batch)
        dims = model.mesh_dimensions(batch.cell)[0]
        forces, energy = _forces(model, batch)
        estimate = pme.rms_force_error(pme.mesh_error_functional(batch.cell[0], dims, model.alpha, 6),
                                       batch.charges, float(batch.cell[0].det().abs()))
        rows.append({"spline": spline, "mesh spacing A": spacing, "mesh": "x".join(map(str, dims)), "estimate eV/A": estimate,
                     "PME err eV/A": _rms(forces, reference[0]),
                     "dE/atom eV": abs(energy - reference[1]) / batch.num_atoms})
        print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two systems, accuracy 1e-5 and 1e-6")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from mlipdd_ewald_pme.testing import accuracy_systems, rock_salt_mgo

    systems = accuracy_systems()
    committed = set(systems)
    accuracies = ACCURACIES
    if args.quick:
        systems = dict(list(systems.items())[:2])
        accuracies = (1e-5, 1e-6)
    else:
        systems["MgO, formal +-2 (for scale; not in the criterion)"] = rock_salt_mgo()
    rows = accuracy_rows(systems, accuracies)
    floor = floor_rows(accuracy_systems()["NaCl crystal (212 ions)"]) if not args.quick else []
    failures = [r for r in rows if r["system"] in committed and r["err / accuracy"] > 3.0]
    columns = ["system", "accuracy", "spline", "mesh", "spacing A", "PME err eV/A", "err / accuracy", "estimate eV/A",
               "old mesh err", "Ewald k err", "K-P estimate", "PME total err", "dE/atom eV", "PME s"]
    notes = (
        f"cutoff {CUTOFF} A, spline order 6, float64, one thread. 'PME err': RMS over atoms of |F_PME - F_Ewald| "
        "with Ewald at the same alpha and real-space cutoff and a converged k-space (the mesh's error alone); "
        "'estimate': the Deserno-Holm functional of this PME (exact alias sum) times k_e sum q^2 / sqrt(N V); "
        "'old mesh err': the previous default mesh (Nyquist of Ewald's k-cutoff); 'Ewald k err': Ewald at the "
        "same accuracy against the converged one; 'K-P estimate': Kolafa-Perram for Ewald's k-space (equal to "
        "its real-space estimate at this splitting); 'PME total err': against a 14 A, 1e-14 Ewald (real-space "
        "truncation included).\n\n"
        f"Criterion (committed systems, accuracy 1e-4..1e-8: PME err <= 3 x accuracy): "
        f"{'met' if not failures else 'NOT met: ' + ', '.join(r['system'] + ' ' + str(r['accuracy']) for r in failures)}.\n\n"
        "The default mesh aims at half of Ewald's k-space error at the same accuracy (charge-independent; "
        "both scale with k_e sum q^2 / sqrt(N V)). In eV/A that is about 1-2 x accuracy for unit charges at "
        "solid or liquid density, and grows with <q^2> sqrt(N/V): for MgO with +-2 charges the Kolafa-Perram "
        "estimate is 14 x accuracy, and the measured total error (real space included) 8-9 x, while its mesh "
        "error stays at 0.7-2.2 x (the meaning of `accuracy` is Ewald's, exp(-alpha^2 rc^2)).\n"
    )
    if floor:
        from _common import markdown_table

        notes += ("\n## Floor of the Warp spline kernels (NaCl crystal, accuracy 1e-9, explicit mesh spacing)\n\n"
                  + markdown_table(floor, ["spline", "mesh spacing A", "mesh", "estimate eV/A", "PME err eV/A", "dE/atom eV"])
                  + "\nnvalchemiops 0.5.0's spread and gather kernels skip every stencil weight below 1e-8 (in "
                  "float64 too; not a float32 effect): an order-6 atom loses ~5e-8 of its charge. With them "
                  "the error stops falling near 1e-7 eV/A (forces) and 1e-8..1e-7 eV/atom (energy), whatever "
                  "the mesh; the plain-torch spline ops (spline='torch') have no threshold and keep "
                  "converging.\n")
    name = "ewald_pme_accuracy_quick" if args.quick else "ewald_pme_accuracy"
    print(write_results(name, "PME accuracy at the default mesh (RMS force error vs converged Ewald)",
                        rows, columns, notes))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
