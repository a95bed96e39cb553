"""`MLIPDDCalculator`: any mlipdd model as an ASE calculator, on one process or N ranks."""

from __future__ import annotations

import atexit
import weakref

import numpy as np
import torch
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes

from mlipdd.data import AtomicData


class MLIPDDCalculator(Calculator):
    """ASE calculator for an mlipdd model wrapper (LJ, MACE, UMA, your own).

    ``MLIPDDCalculator(model, nproc=1)`` evaluates the model in this process.
    ``nproc=N`` starts N ranks once (gloo on CPU, NCCL with one GPU each when
    ``device="cuda"``) and keeps them for every later call: each call sends the system to
    the ranks, runs it domain-decomposed (`DistributedModel` with ``config``) and returns
    the gathered results. ``model`` may also be a zero-argument factory; every rank then
    builds the model itself (the factory must give every rank identical weights). A model
    object is pickled to the ranks, so its class must be importable: in a script, create
    the calculator under ``if __name__ == "__main__":``.

    Results: ``energy`` / ``free_energy`` (eV), ``forces`` (eV/A), ``stress`` (eV/A^3, ASE's
    Voigt order and sign; periodic cells only) and ``charges`` when the model outputs them.
    Close it with ``calc.close()``, a ``with`` block, or let ``atexit`` do it.
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress", "charges"]

    def __init__(self, model, nproc: int = 1, config=None, device: str | None = None,
                 dtype: torch.dtype | None = None, **kwargs):
        super().__init__(**kwargs)
        if int(nproc) < 1:
            raise ValueError(f"nproc must be at least 1, got {nproc}")
        self.nproc = int(nproc)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        local = _build_local(model)
        self.dtype = dtype or _model_dtype(local)
        self._model = local.to(self.device) if self.nproc == 1 else None
        self._pool = None
        if self.nproc > 1:
            from mlipdd.ase.workers import RankPool
            from mlipdd.distributed.config import DomainConfig

            config = config if config is not None else DomainConfig(cutoff=local.cutoff)
            self._pool = RankPool(model, config, self.nproc, self.device)
            # a weak reference: atexit must not keep the calculator (and its ranks) alive
            self._finalizer = weakref.finalize(self, self._pool.close)
            atexit.register(self._finalizer)

    # ---- ASE ------------------------------------------------------------------------------
    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        periodic = bool(np.all(self.atoms.pbc))
        if "stress" in properties and not periodic:
            raise PropertyNotImplementedError("stress needs a cell periodic in all three directions")
        # checked here, in the parent: bad input then never reaches (and never stops) the ranks
        batch = AtomicData.from_ase(self.atoms, dtype=self.dtype).validate()
        out = self._evaluate(batch, compute_stress=periodic)
        energy = float(out["energy"].reshape(-1)[0])
        self.results = {
            "energy": energy,
            "free_energy": energy,
            "forces": out["forces"].detach().cpu().double().numpy(),
        }
        if periodic and "stress" in out:
            s = out["stress"].reshape(3, 3).detach().cpu().double().numpy()
            self.results["stress"] = s[[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]]
        if "charges" in out:
            self.results["charges"] = out["charges"].detach().cpu().double().numpy().reshape(-1)

    def _evaluate(self, batch, compute_stress: bool) -> dict[str, torch.Tensor]:
        if self._pool is not None:
            return self._pool.evaluate(batch, compute_stress)
        out = self._model(batch.to(self.device), compute_stress=compute_stress)
        return {k: v.detach() for k, v in out.items() if torch.is_tensor(v)}

    # ---- lifetime -------------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks (empty for ``nproc=1`` or once closed)."""
        return self._pool.pids if self._pool is not None else []

    def close(self) -> None:
        """Stop the ranks (nothing to do for ``nproc=1``); safe to call twice."""
        if self._pool is not None:
            self._finalizer()
            atexit.unregister(self._finalizer)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _build_local(model):
    """The model object in this process (a factory is called once here for cutoff/dtype)."""
    from torch import nn

    from mlipdd.ase.workers import _build

    built = _build(model)
    if not isinstance(built, nn.Module) or not hasattr(built, "model_config"):
        from mlipdd.plugins import wrap_model

        built = wrap_model(built)  # a raw upstream model (MACE, UMA) its plugin recognises
    return built


def _model_dtype(model) -> torch.dtype:
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float64
