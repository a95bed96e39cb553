"""`MACEWrapper`: any mace `MACE` / `ScaleShiftMACE` model as an mlipdd `ModelWrapper`.

Single-process code, free of distributed logic: under domain decomposition the core
hands it a halo-padded batch and the `SPEC_MPNN_HALO` spec makes mace's scatters and
per-system sums exchange ghost rows (see docs/architecture.md, "One distributed forward").
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from mlipdd.data import Batch
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.shard import is_distributed
from mlipdd_mace.chunked import chunked_blocks, estimate_memory
from mlipdd_mace.cueq import tensor_product_path, to_cueq, uses_cuequivariance
from mlipdd_mace.cueq_aten import aten_kernels
from mlipdd_mace.graph import cartesian_shifts, mace_inputs, one_hot_elements
from mlipdd_mace.versions import require_mace


def is_mace_model(obj) -> bool:
    """True for a raw mace energy model (`MACE` and subclasses such as `ScaleShiftMACE`).

    Decides from the class's module names first, so asking about a non-mace object
    never pays for importing mace (and e3nn).
    """
    if not any(cls.__module__.split(".")[0] == "mace" for cls in type(obj).__mro__):
        return False
    try:
        from mace.modules.models import MACE
    except ImportError:
        return False
    return isinstance(obj, MACE)


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _pick_head(heads: list[str], head: str | None) -> int:
    """Index of the readout head to use; mirrors how mace's calculator chooses."""
    if head is not None:
        if head not in heads:
            raise ValueError(f"the MACE model has no head {head!r}; its heads are {heads}")
        return heads.index(head)
    if len(heads) == 1:
        return 0
    defaults = [i for i, h in enumerate(heads) if h.lower() == "default"]
    if not defaults:
        raise ValueError(
            f"this multi-head MACE model has heads {heads} and none is 'default'; "
            "choose one with MACEWrapper(model, head=...)"
        )
    return defaults[0]


class MACEWrapper(ModelWrapper):
    """Energy, forces, stress and per-atom energies from a mace model.

    Forces and stress come from mace's own autograd (w.r.t. the positions tensor it is
    given and a symmetric strain), so they match mace's ASE calculator exactly.

    ``chunk_atoms``: evaluate the interaction blocks ``chunk_atoms`` receiver atoms' worth
    of edges at a time and the product blocks ``chunk_atoms`` rows at a time, recomputing
    each chunk in the backward (`mlipdd_mace.chunked`). Same energy and forces (float64:
    ~1e-15), a fraction of the memory, some recomputation; inference only (training mode
    runs the plain model). ``memory_estimate(n_atoms, n_edges)`` says what a call needs.

    ``cueq=True``: convert an e3nn model with mace's own e3nn->cuEquivariance converter
    (`mlipdd_mace.cueq.to_cueq`; ``conv_fusion`` None fuses the convolutions on CUDA, as
    mace does). ``model_config.extra["tensor_products"]`` (and the repr) says which path
    runs: ``"e3nn"`` or e.g. ``"cuequivariance (fused conv, CUDA kernels)"``.
    """

    # On several ranks (DomainConfig(strategy=None), the default) sharded storage: the
    # node-wise layers then run on owned rows only (1.96x on 2 H200s vs 1.78x under halo).
    preferred_strategy = "sharded"

    def __init__(self, model: torch.nn.Module, head: str | None = None, chunk_atoms: int | None = None,
                 cueq: bool = False, conv_fusion: bool | None = None):
        super().__init__()
        if chunk_atoms is not None and int(chunk_atoms) < 1:
            raise ValueError(f"chunk_atoms must be a positive number of atoms or None, got {chunk_atoms}")
        self.chunk_atoms = None if chunk_atoms is None else int(chunk_atoms)
        self._input_cache: dict = {}  # see graph._cached_one_hot
        self.mace_version = require_mace()
        if not is_mace_model(model):
            raise TypeError(
                f"MACEWrapper needs a mace.modules.MACE (or ScaleShiftMACE) model, got "
                f"{type(model).__name__}; load one with MACEWrapper.from_file(path) or "
                "MACEWrapper.from_foundation(name)"
            )
        if cueq:
            model = to_cueq(model, conv_fusion=conv_fusion)
        elif conv_fusion is not None:
            raise ValueError("conv_fusion chooses how cueq=True converts; pass cueq=True with it")
        self.model = model
        self.cuequivariance = uses_cuequivariance(model)
        heads = list(getattr(model, "heads", None) or ["Default"])
        self.head = heads[_pick_head(heads, head)]
        self.head_index = heads.index(self.head)
        dtype = _model_dtype(model)
        self.model_config = ModelConfig(
            neighbor_config=NeighborConfig(cutoff=float(model.r_max)),
            outputs=frozenset({"energy", "energies", "forces", "stress"}),
            autograd_outputs=frozenset({"forces", "stress"}),
            supported_dtypes=(dtype,),
            extra={
                "atomic_numbers": tuple(int(z) for z in model.atomic_numbers.tolist()),
                "heads": tuple(heads),
                "cuequivariance": self.cuequivariance,
                "tensor_products": tensor_product_path(model),
                "mace_version": self.mace_version,
            },
        )
        # Inference by default: mace then skips create_graph in its force backward.
        # Call .train() to keep the graph (e.g. to fit on forces).
        self.eval()

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_file(
        cls, path: str | Path, device: str | torch.device = "cpu", head: str | None = None,
        dtype: torch.dtype | None = None, cueq: bool = False, conv_fusion: bool | None = None,
        chunk_atoms: int | None = None,
    ) -> MACEWrapper:
        """A model saved with ``torch.save(model, path)`` (mace's ``.model`` files).

        ``dtype`` converts the loaded model (``torch.float32`` / ``torch.float64``), as
        MACECalculator's ``default_dtype`` does; None keeps the file's. ``cueq=True``
        converts it (on ``device``, after ``dtype``) with mace's e3nn->cuEquivariance
        converter; a file that holds a converted model is used as it is.

        ``weights_only=False`` because mace checkpoints pickle the whole module, not a
        state dict; unpickling runs code from the file, so load only files you trust
        (your own training runs, mace's official releases).
        """
        require_mace()  # the unpickler needs mace's classes importable
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"no MACE model file at {str(path)!r}; give the path of a saved .model file"
            )
        try:
            model = torch.load(path, map_location=device, weights_only=False)
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("cuequivariance"):
                raise
            from mlipdd_mace.cueq import INSTALL_HINT

            raise ImportError(
                f"{str(path)!r} holds a cuEquivariance MACE model, and {exc.name} is not installed; "
                f"{INSTALL_HINT}"
            ) from exc
        # map_location moves parameters and buffers; e3nn's generated modules keep some
        # constants (Wigner 3j tables) as plain attributes, which only .to(device) moves
        # (on the H200 an e3nn file loaded with device="cuda" failed in a tensordot)
        model = model.to(device) if dtype is None else model.to(device=device, dtype=dtype)
        return cls(model, head=head, chunk_atoms=chunk_atoms, cueq=cueq, conv_fusion=conv_fusion)

    @classmethod
    def from_foundation(
        cls, name: str = "medium-mpa-0", device: str | torch.device = "cpu", head: str | None = None,
        dtype: torch.dtype | None = None, cueq: bool = False, conv_fusion: bool | None = None,
        chunk_atoms: int | None = None,
    ) -> MACEWrapper:
        """A pretrained foundation model by name, via mace's own downloader and cache.

        See `mlipdd_mace.foundation` for the names (``"medium-mpa-0"``, ``"off:small"``, ...).
        """
        require_mace()
        from mlipdd_mace.foundation import load_foundation

        model = load_foundation(name, device=device)
        model = model if dtype is None else model.to(dtype)
        return cls(model, head=head, cueq=cueq, conv_fusion=conv_fusion, chunk_atoms=chunk_atoms)

    def to_cueq(self, conv_fusion: bool | None = None) -> MACEWrapper:
        """This wrapper's model converted to cuEquivariance (a new wrapper; same head and
        chunking); itself when it already runs cuEquivariance."""
        if self.cuequivariance:
            return self
        return type(self)(self.model, head=self.head, chunk_atoms=self.chunk_atoms, cueq=True,
                          conv_fusion=conv_fusion)

    def _apply(self, fn, recurse=True):
        # .to(dtype) converts the mace model inside: the dtype this wrapper accepts follows
        # it (else a float32 model kept refusing float32 input, asking for float64)
        out = super()._apply(fn, recurse)
        if dataclasses.is_dataclass(getattr(self, "model_config", None)):
            self.model_config = dataclasses.replace(self.model_config, supported_dtypes=(self.dtype,))
        return out

    # ---- ModelWrapper protocol ----------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return _model_dtype(self.model)

    def adapt_input(self, batch: Batch) -> dict:
        return mace_inputs(
            batch,
            model_elements=self.model.atomic_numbers,
            cutoff=self.cutoff,
            dtype=self.dtype,
            head=self.head_index,
            cache=self._input_cache,
        )

    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        data = self.adapt_input(batch)
        positions = data["positions"]
        # mace calls positions.requires_grad_(True) in place; undo it afterwards on a
        # leaf the caller handed in, so an integrator can still update it in place.
        restore_flag = positions.is_leaf and not positions.requires_grad
        keep_graph = self.training and torch.is_grad_enabled()
        chunking = (
            chunked_blocks(self.model, self.chunk_atoms)
            if self.chunk_atoms is not None and not keep_graph else contextlib.nullcontext()
        )
        # cuEq kernels read raw rows: under domain decomposition each call is one adapted
        # call (NOTE [cuEq kernels under aten] in mlipdd_mace.cueq_aten)
        cueq_rows = (aten_kernels(self.model) if self.cuequivariance and is_distributed(positions)
                     else contextlib.nullcontext())
        try:
            # forces are an autograd derivative, even in no_grad
            with torch.enable_grad(), chunking, cueq_rows:
                out = self.model(
                    data,
                    training=keep_graph,
                    compute_force=True,
                    compute_stress=compute_stress,
                )
        finally:
            if restore_flag:
                positions.requires_grad_(False)
        energy = out["energy"]
        result = {
            "energy": energy,
            "forces": out["forces"],
            # ScaleShiftMACE returns per-atom energies in float64 whatever the model dtype.
            "energies": out["node_energy"].to(energy.dtype),
        }
        if compute_stress:
            result["stress"] = out["stress"]
        return result

    # ---- compile hooks (DomainConfig(compile=True) at several ranks) --------------------
    @property
    def message_passing_layers(self) -> int:
        """Neighbour hops an atom's energy reads: one per interaction block (the ghost shell
        of a compiled run at several ranks, NOTE [deep ghost shell] in
        mlipdd.distributed.compiled_halo)."""
        return int(self.model.num_interactions)

    def atomic_energies(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        """mace's per-atom energies (``node_energy``) at ``positions`` and ``cell`` (strained
        ones for the stress), still attached to them: the compiled path at several ranks
        sums the owned atoms' ones and differentiates itself (`forward` lets mace sum them
        all). Plain rows only; the eager paths never call it."""
        # the inputs of ``batch`` itself (a view would lose the padded batch's fixed atom
        # counts, whose bincount breaks the graph), at the given positions and cell; no input
        # cache: it may hold the eager distributed call's ShardTensors, which dynamo cannot
        # take as graph inputs
        data = mace_inputs(batch, model_elements=self.model.atomic_numbers, cutoff=self.cutoff, dtype=self.dtype,
                           head=self.head_index, cache=None)
        cell = cell.to(self.dtype)
        data.update(positions=positions.to(self.dtype), cell=cell,
                    shifts=cartesian_shifts(data["unit_shifts"], cell, batch.batch[data["edge_index"][0]]))
        with torch.enable_grad():
            out = self.model(data, training=False, compute_force=False, compute_stress=False)
        return out["node_energy"].to(self.dtype)

    def atomic_reference_energies(self, atomic_numbers: torch.Tensor) -> torch.Tensor:
        """Each atom's isolated-atom energy E0 (eV) for this head, the part of ``energies``
        that mace adds per element: ``energies`` minus this is MACECalculator's
        ``node_energy`` (what `mlipdd.ase.MLIPDDCalculator` returns under that name)."""
        one_hot = one_hot_elements(atomic_numbers, self.model.atomic_numbers, self.dtype)
        # mace's own block, as its forward computes node_e0: [atoms, heads]
        return self.model.atomic_energies_fn(one_hot)[:, self.head_index].detach()

    def memory_estimate(self, n_atoms: int, n_edges: int) -> dict:
        """Rough peak bytes of one energy + forces call on ``n_atoms`` rows (owned + ghost
        under domain decomposition) with ``n_edges`` edges, for this wrapper's
        ``chunk_atoms`` and the plain model; ``summary`` is a line to print before a run."""
        itemsize = torch.finfo(self.dtype).bits // 8
        plain = estimate_memory(self.model, n_atoms, n_edges, None, itemsize)["bytes"]
        chunked = estimate_memory(self.model, n_atoms, n_edges, self.chunk_atoms, itemsize)["bytes"]
        mine = plain if self.chunk_atoms is None else chunked
        summary = (f"MACE memory estimate: {n_atoms} atoms, {n_edges} edges -> ~{mine / 2**30:.1f} GiB "
                   f"(chunk_atoms={self.chunk_atoms}; plain model ~{plain / 2**30:.1f} GiB)")
        return {"bytes": mine, "plain_bytes": plain, "summary": summary}

    def distribution_spec(self, strategy=None):
        """Spatial halo: mace is a message-passing network with a fixed neighbour list."""
        from mlipdd.spec import SPEC_MPNN_HALO

        return SPEC_MPNN_HALO

    def extra_repr(self) -> str:
        cfg = self.model_config
        return (
            f"cutoff={cfg.cutoff}, elements={list(cfg.extra['atomic_numbers'])}, head={self.head!r}, "
            f"dtype={self.dtype}, tensor_products={cfg.extra['tensor_products']!r}, "
            f"chunk_atoms={self.chunk_atoms}"
        )
