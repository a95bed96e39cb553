"""`UMAWrapper`: a fairchem UMA model (eSCN-MD backbone + heads) as an mlipdd `ModelWrapper`.

Single-process code. The backbone builds its own radius graph inside ``forward``; the
halo spec (`mlipdd_uma.halo`) swaps that graph construction, and a few reductions
the ShardTensor dispatch cannot see, for distribution-aware versions while a
distributed forward runs. Forces and stress come from fairchem's own heads (autograd
of the energy with respect to positions and cell), so they match fairchem exactly.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from mlipdd.data import Batch, InputError
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig

from mlipdd_uma.inputs import uma_inputs, wrap_into_cell
from mlipdd_uma.versions import require_fairchem

_DEFAULT_SPIN = {"omol": 1}  # fairchem's defaults: multiplicity 1 for molecules, else 0


def is_uma_model(obj) -> bool:
    """True for a fairchem Hydra model whose backbone is an eSCN-MD (UMA) backbone.

    Decides from module names first, so a non-fairchem object never imports fairchem.
    """
    backbone = getattr(obj, "backbone", None)
    if backbone is None or not type(backbone).__module__.startswith("fairchem."):
        return False
    from fairchem.core.models.uma.escn_md import eSCNMDBackbone

    return isinstance(backbone, eSCNMDBackbone) and hasattr(obj, "output_heads")


def _unwrap(value, key: str):
    return value[key] if isinstance(value, dict) else value


def _model_tasks(model) -> dict:
    """The model's fairchem tasks (normalizers, element references), or {} when not set up."""
    try:
        return dict(model.tasks or {})
    except (AttributeError, RuntimeError, TypeError):
        return {}


class UMAWrapper(ModelWrapper):
    """Energy (n_systems), forces and stress from a UMA model, for one task.

    ``task`` is UMA's dataset name ("omat", "omol", "oc20", "odac", "omc"); it may be
    left out when the model knows a single one. ``charge`` / ``spin`` are used for
    systems whose batch carries no ``charge`` / ``spin`` (spin defaults to 1 for
    "omol", 0 otherwise, as in fairchem).
    """

    def __init__(self, model: torch.nn.Module, task: str | None = None, charge: int = 0,
                 spin: int | None = None):
        super().__init__()
        self.fairchem_version = require_fairchem()
        if not is_uma_model(model):
            raise TypeError(
                f"UMAWrapper needs a fairchem Hydra model with an eSCN-MD backbone, got "
                f"{type(model).__name__}; load one with UMAWrapper.from_checkpoint(path) or "
                "UMAWrapper.from_pretrained(name), or build one with mlipdd_uma.testing.random_uma"
            )
        backbone = model.backbone
        dtypes = {p.dtype for p in model.parameters()}
        if dtypes != {torch.float32}:
            raise TypeError(
                f"UMA runs in float32 only, but the model's parameters are {sorted(map(str, dtypes))}; "
                "convert it with model.float()"
            )
        if backbone.regress_config.direct_forces:
            raise ValueError(
                "this UMA model predicts forces directly (direct_forces=True); mlipdd runs "
                "conserving models whose forces are the energy gradient: use a conserving checkpoint"
            )
        if not backbone.otf_graph:
            raise ValueError(
                "the backbone expects an external graph (otf_graph=False); UMAWrapper lets the model "
                "build its own: load it with the inference setting external_graph_gen=False"
            )
        self.model = model
        self.tasks = _model_tasks(model)
        self.task = self._pick_task(task)
        self.charge = int(charge)
        self.spin = int(spin if spin is not None else _DEFAULT_SPIN.get(self.task, 0))
        self.model_config = ModelConfig(
            neighbor_config=NeighborConfig(cutoff=float(backbone.cutoff)),
            outputs=frozenset({"energy", "forces", "stress"}),
            autograd_outputs=frozenset({"forces", "stress"}),
            supported_dtypes=(torch.float32,),
            extra={
                "task": self.task,
                "tasks": tuple(self.known_tasks),
                "max_neighbors": int(backbone.max_neighbors),
                "fairchem_version": self.fairchem_version,
            },
        )
        self.eval()

    # ---- tasks ----------------------------------------------------------------------
    @property
    def known_tasks(self) -> list[str]:
        mapping = getattr(self.model.backbone, "dataset_mapping", None) or {}
        return sorted(mapping)

    def _pick_task(self, task: str | None) -> str:
        known = self.known_tasks
        if task is None:
            if len(known) == 1:
                return known[0]
            raise ValueError(f"this UMA model serves several tasks {known}; choose one with task=...")
        if known and task not in known:
            raise ValueError(f"the UMA model has no task {task!r}; its tasks are {known}")
        return task

    # ---- constructors -----------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path: str | Path, task: str | None = None, device: str = "cpu",
                        **kwargs) -> UMAWrapper:
        """A fairchem inference checkpoint file (``.pt``), loaded by fairchem's own loader."""
        from mlipdd_uma.loading import load_checkpoint

        return cls(load_checkpoint(path, device=device), task=task, **kwargs)

    @classmethod
    def from_pretrained(cls, name: str = "uma-s-1p1", task: str | None = None, device: str = "cpu",
                        **kwargs) -> UMAWrapper:
        """A released UMA model by name, through fairchem's pretrained loader (downloads
        from Hugging Face on first use; see `mlipdd_uma.loading`)."""
        from mlipdd_uma.loading import load_pretrained

        return cls(load_pretrained(name, device=device), task=task, **kwargs)

    # ---- forward ----------------------------------------------------------------------
    def place_in_cell(self, positions: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor,
                      system: torch.Tensor) -> torch.Tensor:
        """Positions inside the cell along periodic axes (fairchem's graph code assumes it).

        A method of its own so the halo spec can replace it: ghost atoms must stay at
        their periodic images.
        """
        return wrap_into_cell(positions, cell, pbc, system)

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        if batch.dtype != torch.float32:
            raise InputError(
                f"UMA runs in float32 only, but the batch positions are {batch.dtype}; convert the "
                "batch with batch.to(dtype=torch.float32)"
            )
        positions = batch.positions
        # fairchem switches requires_grad on in place: hand it tensors the caller does not own
        if positions.is_leaf and not positions.requires_grad:
            positions = positions.detach().clone()
        cell = batch.cell.detach().clone()
        positions = self.place_in_cell(positions, cell, batch.pbc.bool(), batch.batch)
        data = uma_inputs(batch, self.task, self.charge, self.spin, positions, cell)
        with self._stress_requested(compute_stress), torch.enable_grad():
            out = self.model(data)
        return self._read_outputs(out, data, batch.num_systems, compute_stress, positions.dtype)

    @contextmanager
    def _stress_requested(self, compute_stress: bool):
        """Heads compute stress when the backbone's shared regress_config says so; ask
        for it only when wanted (a cell-free molecule has no stress)."""
        config = self.model.backbone.regress_config
        saved = (config.stress, config.forces)
        config.stress, config.forces = bool(compute_stress), True
        try:
            yield
        finally:
            config.stress, config.forces = saved

    def _read_outputs(self, out: dict, data, n_systems: int, compute_stress: bool, dtype) -> dict:
        found = self._task_outputs(out, data) if self.tasks else self._head_outputs(out)
        missing = [k for k in ("energy", "forces") if k not in found]
        if compute_stress and "stress" not in found:
            missing.append("stress")
        if missing:
            raise RuntimeError(
                f"the UMA model returned no {missing} for task {self.task!r} (outputs: {sorted(out)}); "
                "use a conserving energy/forces/stress head (MLP_EFS_Head)"
            )
        result = {
            "energy": found["energy"].reshape(n_systems).to(dtype),
            "forces": found["forces"].to(dtype),
        }
        if compute_stress:
            result["stress"] = found["stress"].reshape(n_systems, 3, 3).to(dtype)
        if not self.training:  # inference: do not keep the forward's graph alive in the outputs
            result = {k: v.detach() for k, v in result.items()}
        return result

    @staticmethod
    def _head_outputs(out: dict) -> dict:
        """A model without fairchem tasks: read the heads' raw energy/forces/stress."""
        found = {}
        for head_out in out.values():
            if not isinstance(head_out, dict):
                continue
            for key in ("energy", "forces", "stress"):
                if key in head_out and key not in found:
                    found[key] = _unwrap(head_out[key], key)
        return found

    def _task_outputs(self, out: dict, data) -> dict:
        """A model with fairchem tasks: denormalise and add element references, as
        fairchem's predict unit does."""
        found = {}
        for name, task in self.tasks.items():
            if self.task not in task.datasets or name not in out:
                continue
            value = task.normalizer.denorm(_unwrap(out[name], task.property))
            if task.property == "energy" and task.element_references is not None:
                value = task.element_references.undo_refs(data, value)
            found[task.property] = value
        return found

    # ---- distribution ---------------------------------------------------------------
    def distribution_spec(self, strategy=None):
        """Spatial halo by default; node-partition graph partition for GRAPH_PARTITION."""
        from mlipdd_uma.spec import uma_spec

        return uma_spec(strategy)

    def extra_repr(self) -> str:
        return f"task={self.task!r}, cutoff={self.cutoff}, charge={self.charge}, spin={self.spin}"
