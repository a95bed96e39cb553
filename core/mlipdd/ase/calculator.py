"""`MLIPDDCalculator`: any mlipdd model as an ASE calculator, on one process or N ranks."""

from __future__ import annotations

import numpy as np
import torch
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes

from mlipdd.data import AtomicData
from mlipdd.distributed.rank_pool import ModelEvaluator


class MLIPDDCalculator(Calculator):
    """ASE calculator for an mlipdd model wrapper (LJ, MACE, UMA, your own).

    ``MLIPDDCalculator(model, nproc=1)`` evaluates the model in this process.
    ``nproc=N`` starts N ranks once (gloo on CPU, NCCL with one GPU each when
    ``device="cuda"``) and keeps them for every later call: each call sends the system to
    the ranks, runs it domain-decomposed (`DistributedModel` with ``config``, default
    ``DomainConfig(cutoff=model.cutoff)``) and returns the gathered results. ``model`` may
    also be a zero-argument factory; every rank then builds the model itself (the factory
    must give every rank identical weights). A model object is pickled to the ranks, so its
    class must be importable: in a script, create the calculator under
    ``if __name__ == "__main__":``.

    Results: ``energy`` / ``free_energy`` (eV), ``forces`` (eV/A), ``stress`` (eV/A^3, ASE's
    Voigt order and sign; periodic cells only) and ``charges`` when the model outputs them.
    Close it with ``calc.close()``, a ``with`` block, or let ``atexit`` do it.
    """

    implemented_properties = ("energy", "free_energy", "forces", "stress", "charges")

    def __init__(self, model, nproc: int = 1, config=None, device: str | None = None,
                 dtype: torch.dtype | None = None, **kwargs):
        super().__init__(**kwargs)
        self.evaluator = ModelEvaluator(model, nproc, config, device, dtype)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        periodic = bool(np.all(self.atoms.pbc))
        if "stress" in properties and not periodic:
            raise PropertyNotImplementedError("stress needs a cell periodic in all three directions")
        # checked here, in the parent: bad input then never reaches (and never stops) the ranks
        batch = AtomicData.from_ase(self.atoms, dtype=self.evaluator.dtype).validate()
        out = self.evaluator.evaluate(batch, compute_stress=periodic)
        energy = float(out["energy"].reshape(-1)[0])
        self.results = {
            "energy": energy,
            "free_energy": energy,
            "forces": _numpy(out["forces"]),
        }
        if periodic and "stress" in out:
            s = _numpy(out["stress"]).reshape(3, 3)
            self.results["stress"] = s[[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]]
        if "charges" in out:
            self.results["charges"] = _numpy(out["charges"]).reshape(-1)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks (empty for ``nproc=1`` or once closed)."""
        return self.evaluator.pids

    def close(self) -> None:
        """Stop the ranks (nothing to do for ``nproc=1``); safe to call twice."""
        self.evaluator.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().double().numpy()
