"""`MLIPDDCalculator`: any mlipdd model as an ASE calculator, on one process or N ranks."""

from __future__ import annotations

import numpy as np
import torch
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes

from mlipdd.data import AtomicData
from mlipdd.distributed.rank_pool import ModelEvaluator

_DEFAULT_TIMEOUT_S = 300.0
OPEN_SYSTEM_VACUUM = 10.0  # Angstrom on every side, as `mlipdd run` gives a molecule


class MLIPDDCalculator(Calculator):
    """ASE calculator for an mlipdd model wrapper (LJ, MACE, UMA, your own).

    ``MLIPDDCalculator(model, nproc=1)`` evaluates the model in this process.
    ``nproc=N`` starts N ranks once (gloo on CPU, NCCL with one GPU each when
    ``device="cuda"``) and keeps them for every later call: each call sends the system to
    the ranks, runs it domain-decomposed (`DistributedModel` with ``config``, default
    ``DomainConfig(cutoff=model.cutoff)``) and returns the gathered results. ``model`` may
    also be a zero-argument factory; every rank then builds the model itself (the factory
    must give every rank identical weights). A model object is pickled to the ranks, so its
    class must be importable, and in a script the calculator must be created under
    ``if __name__ == "__main__":`` (the ranks re-import the script; a script without the
    guard is refused with that fix).

    ``pool=RankPool(model, nproc)`` instead of a model: several calculators (the images of
    an NEB) share one set of ranks; the pool's owner closes it.

    A molecule or cluster without a box runs at ``nproc > 1`` in a non-periodic box with
    10 A of vacuum around it (the ranks split a box; said once in a warning; ASE's atoms are
    left as they are).

    ``dtype`` converts the model (as MACECalculator's ``default_dtype``): results are
    computed in that precision. ``timeout``: seconds a call may take on the ranks before
    it fails naming the rank that did not answer.

    Every call answers or raises: bad input (an element the model lacks, overlapping atoms,
    NaN positions) raises `InputError` and the calculator serves the next call; a non-finite
    result raises `FloatingPointError`; a rank that dies or is stopped raises `WorkerError`
    naming it, and the next call starts new ranks.

    Results: ``energy`` / ``free_energy`` (eV), ``forces`` (eV/A), ``energies`` (per atom,
    eV; `Atoms.get_potential_energies`), ``node_energy`` (per atom less the element's
    isolated-atom energy E0, as MACECalculator's; for a wrapper with
    ``atomic_reference_energies``, as MACEWrapper), ``stress`` (eV/A^3, ASE's Voigt order and sign;
    for a cell with three non-zero vectors, periodic in two or three directions: a slab's
    stress uses the volume of its cell, vacuum included, as MACECalculator does) and any
    other per-atom output the model gives (``charges``). Close it with ``calc.close()``, a
    ``with`` block, or let ``atexit`` do it.
    """

    implemented_properties = ("energy", "free_energy", "forces", "stress", "energies", "node_energy",
                              "charges")

    def __init__(self, model=None, nproc: int = 1, config=None, device: str | None = None,
                 dtype: torch.dtype | None = None, pool=None, timeout: float = _DEFAULT_TIMEOUT_S,
                 **kwargs):
        super().__init__(**kwargs)
        self.evaluator = ModelEvaluator(model, nproc, config, device, dtype, pool=pool, timeout=timeout)
        self._said_boxed = False

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        with_stress = has_stress(self.atoms)
        if "stress" in properties and not with_stress:
            raise PropertyNotImplementedError(
                "stress needs a cell periodic in at least two directions with three non-zero "
                "cell vectors (give a slab its vacuum as a cell vector)"
            )
        # checked here, in the parent: bad input then never reaches (and never stops) the ranks
        batch = AtomicData.from_ase(self.atoms, dtype=self.evaluator.dtype).validate()
        if self.evaluator.nproc > 1:
            self._box_if_open(batch)
        out = self.evaluator.evaluate(batch, compute_stress=with_stress)
        energy = float(out["energy"].reshape(-1)[0])
        self.results = {"energy": energy, "free_energy": energy}
        if with_stress and "stress" in out:
            s = _numpy(out["stress"]).reshape(3, 3)
            self.results["stress"] = s[[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]]
        for name, value in out.items():  # per-atom outputs: forces, energies, charges, ...
            if name not in ("energy", "stress") and value.shape[:1] == (len(self.atoms),):
                rows = _numpy(value)
                self.results[name] = rows.reshape(-1) if rows.ndim == 2 and rows.shape[1] == 1 else rows
        self._add_node_energy(batch)

    def _add_node_energy(self, batch) -> None:
        """MACECalculator's ``node_energy``: the per-atom energies less each element's
        isolated-atom energy E0, for a model that says its E0s (`atomic_reference_energies`)."""
        reference = getattr(self.evaluator.local_model, "atomic_reference_energies", None)
        if reference is None or "energies" not in self.results:
            return
        e0 = reference(batch.atomic_numbers.cpu())
        self.results["node_energy"] = self.results["energies"] - _numpy(e0).reshape(-1)

    def _box_if_open(self, batch) -> None:
        """A molecule or cluster without a usable box gets one with vacuum (the ranks split a
        box; a translation changes no energy or force, and ASE's atoms stay as they are);
        said once per calculator."""
        from mlipdd.vacuum_box import box_open_systems, boxed_message

        boxed = box_open_systems(batch, OPEN_SYSTEM_VACUUM)
        if boxed and not self._said_boxed:
            import warnings

            warnings.warn(boxed_message(boxed, OPEN_SYSTEM_VACUUM), UserWarning, stacklevel=4)
            self._said_boxed = True

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks (empty for ``nproc=1`` or once closed)."""
        return self.evaluator.pids

    def close(self) -> None:
        """Stop the ranks this calculator started (a shared pool's owner closes the pool)."""
        self.evaluator.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def has_stress(atoms) -> bool:
    """Stress is defined for a cell of non-zero volume periodic in two or three directions
    (for a slab the vacuum is part of the volume, as MACECalculator and ASE's own do)."""
    return int(np.sum(atoms.pbc)) >= 2 and abs(float(np.linalg.det(atoms.cell.array))) > 1e-12


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    out = tensor.detach().cpu()
    return out.numpy() if out.dtype in (torch.float32, torch.float64) else out.double().numpy()
