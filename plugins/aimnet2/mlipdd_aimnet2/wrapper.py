"""`AIMNet2Wrapper`: aimnet's `AIMNet2` model as an mlipdd `ModelWrapper`.

Single-process code. The network runs through aimnet's own ``forward_prepared`` on
aimnet's flat neighbour-matrix layout (`mlipdd_aimnet2.inputs`), so the AEV, the
convolutions, the neural charge equilibration (per-system sums in every pass) and the
output heads are aimnet's code. The full Coulomb term that a released model leaves to
its calculator is added here (`mlipdd_aimnet2.coulomb`). Forces come from autograd
of the energy with respect to the positions, stress from the strain route, so both
include the response of the charges (as aimnet's own forces do).
"""

from __future__ import annotations

from pathlib import Path

import torch
from mlipdd.data import Batch, InputError
from mlipdd.distributed.compiled_sums import OWNED_ROWS
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig, strained

from mlipdd_aimnet2.coulomb import (
    SYSTEM_KINDS,
    check_all_pairs,
    coulomb_per_kind,
    dsf_energy,
    dsf_energy_and_forces,
    missing_pairs,
    simple_energy,
)
from mlipdd_aimnet2.ewald import check_fully_periodic, ewald_energy, splitting
from mlipdd_aimnet2.host_reads import HostReads
from mlipdd_aimnet2.inputs import ListMatrices, aimnet_inputs, explicit_convolution_rows
from mlipdd_aimnet2.own_neighbors import (
    aimnet_kernel_matrices,
    aimnet_kernel_neighbors,
    invertible_cells,
    largest_system,
)
from mlipdd_aimnet2.versions import require_aimnet

# Output modules whose work is per atom, per neighbour-matrix row or a per-system sum.
_LOCAL_OUTPUTS = ("Output", "AtomicShift", "AtomicSum", "SRCoulomb")
DEFAULT_DSF_ALPHA = 0.2  # aimnet's calculator defaults for periodic cells
DEFAULT_DSF_CUTOFF = 15.0
DEFAULT_SIMPLE_CUTOFF = 40.0
DEFAULT_EWALD_CUTOFF = 12.0  # real space; aimnet picks it per call from the density (`ewald.aimnet_ewald_cutoff`)
DEFAULT_EWALD_ACCURACY = 1e-6  # aimnet's default ewald_accuracy


def is_aimnet2_model(obj) -> bool:
    """True for aimnet's `AIMNet2` (and subclasses); never imports aimnet for other objects."""
    if not any(cls.__module__.split(".")[0] == "aimnet" for cls in type(obj).__mro__):
        return False
    from aimnet.models import AIMNet2

    return isinstance(obj, AIMNet2)


def _check_outputs(model) -> None:
    for name, module in model.outputs.named_children():
        kind = type(module).__name__
        if kind == "LRCoulomb":
            raise ValueError(
                f"output {name!r} is aimnet's all-pairs LRCoulomb inside the network (the training "
                "layout); convert the model to the released layout first (aimnet's export: "
                "`aimnet.models.utils.strip_lr_modules_from_yaml` puts SRCoulomb inside and the "
                "Coulomb term outside), then choose coulomb='dsf' or 'simple' here"
            )
        if kind not in _LOCAL_OUTPUTS:
            raise NotImplementedError(
                f"output {name!r} ({kind}) is not supported by mlipdd-aimnet2, which runs "
                f"{', '.join(_LOCAL_OUTPUTS)}; remove it from model.outputs or use a model without it"
            )


class AIMNet2Wrapper(ModelWrapper):
    """Energy, forces, stress and per-atom charges from an aimnet `AIMNet2` model.

    ``coulomb``: ``"dsf"`` (damped shifted force, every system; the default for models
    that need Coulomb, as aimnet's calculator does for a batch with a cell), ``"simple"``
    (all pairs, open systems only), ``"none"``, or one per kind of system, e.g.
    ``{"molecule": "simple", "periodic": "dsf"}`` for a batch mixing molecules and
    crystals (a system is periodic when any of its directions is). ``"ewald"`` (cells
    periodic along all three axes): aimnet's Ewald option, real space to ``ewald_cutoff``,
    splitting from ``ewald_accuracy`` (`mlipdd_aimnet2.ewald`). ``charge`` is the total
    charge of systems whose batch carries none (``batch.charge`` wins). ``dispersion``
    must be ``False`` for a model whose metadata asks for DFT-D3 outside the network:
    mlipdd-aimnet2 does not compute it (the energies then lack that term).
    """

    # DomainConfig() on several ranks: sharded storage (no Coulomb-deep ghost shell; see
    # the plugin README for the measured comparison); strategy="halo" still works.
    preferred_strategy = "sharded"

    def __init__(self, model: torch.nn.Module, metadata: dict | None = None, coulomb: str | None = None,
                 dsf_alpha: float = DEFAULT_DSF_ALPHA, dsf_cutoff: float = DEFAULT_DSF_CUTOFF,
                 simple_cutoff: float = DEFAULT_SIMPLE_CUTOFF, charge: float = 0.0,
                 dispersion: bool | None = None, species=None, ewald_cutoff: float = DEFAULT_EWALD_CUTOFF,
                 ewald_accuracy: float = DEFAULT_EWALD_ACCURACY):
        super().__init__()
        self.aimnet_version = require_aimnet()
        if not is_aimnet2_model(model):
            raise TypeError(
                f"AIMNet2Wrapper needs aimnet's AIMNet2 model, got {type(model).__name__}; load one with "
                "AIMNet2Wrapper.from_file(path) or AIMNet2Wrapper.from_name('aimnet2'), or build one with "
                "mlipdd_aimnet2.building.random_aimnet2"
            )
        if model.num_charge_channels != 1:
            raise NotImplementedError(
                "this AIMNet2 has two charge channels (NSE, open-shell); mlipdd-aimnet2 runs closed-shell "
                "models (num_charge_channels=1)"
            )
        _check_outputs(model)
        metadata = dict(metadata if metadata is not None else (getattr(model, "metadata", None) or {}))
        if metadata.get("needs_dispersion") and dispersion is not False:
            raise ValueError(
                "this AIMNet2 expects DFT-D3 dispersion added outside the network (metadata "
                "needs_dispersion=True), which mlipdd-aimnet2 does not compute; pass dispersion=False "
                "to run without it (energies and forces then lack the D3 term)"
            )
        has_sr = any(type(m).__name__ == "SRCoulomb" for m in model.outputs.children())
        needs_coulomb = bool(metadata.get("needs_coulomb", has_sr))
        self.coulomb_methods = coulomb_per_kind(coulomb, needs_coulomb)
        self.model = model
        self.metadata = metadata
        methods = set(self.coulomb_methods.values())
        self.coulomb = methods.pop() if len(methods) == 1 else dict(self.coulomb_methods)
        self.dsf_alpha = float(dsf_alpha)
        self.method_cutoffs = {"dsf": float(dsf_cutoff), "simple": float(simple_cutoff),
                               "ewald": float(ewald_cutoff), "none": 0.0}
        self.ewald_accuracy = float(ewald_accuracy)
        self.ewald_alpha, self.ewald_k_cutoff = splitting(float(ewald_cutoff), self.ewald_accuracy)
        used = [self.method_cutoffs[m] for m in self.coulomb_methods.values() if m != "none"]
        self.coulomb_cutoff = max(used) if used else None
        self.charge = float(charge)
        self._kernel_lists = {}  # cutoff -> aimnet's AdaptiveNeighborList (`own_neighbors`)
        self._list_matrices = ListMatrices()  # NOTE [matrices while the list holds]
        self._host = HostReads()  # host values of device tensors, read once while they are unchanged
        self.short_cutoff = float(model.aev.rc_s)
        if species is None:
            from aimnet.models.utils import extract_species

            species = metadata.get("implemented_species") or extract_species(model)
        self.species = tuple(sorted(int(z) for z in species))
        self.register_buffer("_supported", torch.zeros(128, dtype=torch.bool), persistent=False)
        self._supported[list(self.species)] = True
        cutoff = max(self.short_cutoff, self.coulomb_cutoff or 0.0)
        dtype = next(model.parameters()).dtype
        self.model_config = ModelConfig(
            neighbor_config=NeighborConfig(cutoff=cutoff),
            outputs=frozenset({"energy", "forces", "stress", "charges"}),
            autograd_outputs=frozenset({"forces", "stress"}),
            supported_dtypes=(dtype,),
            extra={"aimnet_version": self.aimnet_version, "coulomb": self.coulomb, "species": self.species},
        )
        model.requires_grad_(False)
        self.eval()

    # ---- constructors -----------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
                  **kwargs) -> AIMNet2Wrapper:
        """An aimnet model file: a v2 ``.pt`` (state dict + metadata), read by aimnet's loader."""
        from mlipdd_aimnet2.building import to_dtype
        from mlipdd_aimnet2.loading import load_file

        model, metadata = load_file(path, device=device)
        return cls(to_dtype(model, dtype), metadata=metadata, **kwargs)

    @classmethod
    def from_name(cls, name: str = "aimnet2", device: str = "cpu", dtype: torch.dtype | None = None,
                  **kwargs) -> AIMNet2Wrapper:
        """A released model by aimnet registry name (downloaded and cached by aimnet)."""
        from mlipdd_aimnet2.building import to_dtype
        from mlipdd_aimnet2.loading import load_named

        model, metadata = load_named(name, device=device)
        return cls(to_dtype(model, dtype), metadata=metadata, **kwargs)

    # ---- input checks -------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def total_charge(self, batch: Batch) -> torch.Tensor:
        """One integer total charge per system: ``batch.charge`` or the wrapper's ``charge``
        (whole numbers: `check_input` refuses others)."""
        charge = batch.charge
        if charge is None:
            charge = torch.full((batch.num_systems,), self.charge, dtype=batch.dtype, device=batch.device)
        return charge.reshape(-1).to(batch.dtype)

    def _periodic(self, batch: Batch) -> list[list[bool]]:
        """``batch.pbc`` on the host, read once per pbc tensor (a GPU batch's every read of it
        waits for the device: this call reads it once, and dynamics never again)."""
        return self._host.get("pbc", (batch.pbc,), lambda: batch.pbc.bool().tolist())

    def _open(self, batch: Batch) -> bool:
        """No system of ``batch`` is periodic (molecules only)."""
        return not any(any(row) for row in self._periodic(batch))

    def check_input(self, batch: Batch) -> None:
        if batch.dtype != self.dtype:
            raise InputError(
                f"the batch positions are {batch.dtype} but the AIMNet2 model is {self.dtype}; convert one: "
                f"batch.to(dtype={self.dtype}) or wrap model.to({batch.dtype})"
            )
        z = batch.atomic_numbers

        def masks():  # (atoms of a supported element, systems whose total charge is not whole)
            charge = self.total_charge(batch)
            return self._supported[z.clamp(0, 127)] & (z < 128), (charge - torch.round(charge)).abs() > 1e-6

        if type(z) is torch.Tensor:
            # one process: one read of the device for both, none again while the numbers and the
            # charges are the same tensors, unchanged (dynamics); the wrapper's own charge (no
            # batch.charge) is a plain number
            keys = (z,) if batch.charge is None else (z, batch.charge)
            def verdicts():
                supported, off = masks()
                return torch.stack([supported.all(), ~off.any()]).tolist()

            species_ok, charges_ok = self._host.get("species and charges", keys, verdicts, also=(self.charge,))
        else:  # DD: each a reduced value of the dispatch (every rank gets the same answer; never
            # memoised: one rank skipping the reduction another takes would hang both)
            supported, off = masks()
            species_ok, charges_ok = bool(supported.all()), not bool(off.any())
        if not species_ok:
            # the distinct unsupported numbers (0 for the supported atoms, no element): a union over
            # ranks under DD (torch.unique of rows), where a mask read z[~supported] is rows of one rank
            supported, _ = masks()
            bad = sorted({int(v) for v in torch.unique(torch.where(supported, 0, z)).tolist()} - {0})
            raise InputError(
                f"AIMNet2 was not trained on atomic number(s) {bad}; it covers {list(self.species)}: "
                "remove those atoms or use a model trained on them"
            )
        if not charges_ok:
            _, off = masks()
            raise InputError(
                f"total charge {self.total_charge(batch)[off].tolist()} of system(s) "
                f"{torch.nonzero(off).flatten().tolist()} is not an integer; AIMNet2 distributes an integer "
                "number of electrons: set the batch's system property 'charge' to whole numbers"
            )
        periodic = self._periodic(batch)
        if self.coulomb_methods["periodic"] == "simple" and any(any(row) for row in periodic):
            raise InputError(
                "coulomb='simple' (aimnet's all-pairs Coulomb) cannot sum a periodic cell: the pairs with "
                "periodic images never end; use coulomb='dsf' for periodic systems, or "
                "coulomb={'molecule': 'simple', 'periodic': 'dsf'} for a batch of both"
            )
        methods = self.system_methods(batch)
        ewald_molecule = not all(any(p) for p, m in zip(periodic, methods) if m == "ewald")
        if self.coulomb_methods["molecule"] == "ewald" and ewald_molecule:
            raise InputError(
                "coulomb='ewald' sums periodic images and the batch has a molecule (periodic nowhere); "
                "use coulomb={'molecule': 'simple', 'periodic': 'ewald'} for a batch of both"
            )
        check_fully_periodic(batch, [m == "ewald" for m in methods], periodic)

    def system_methods(self, batch: Batch) -> list[str]:
        """The Coulomb method of each system (``coulomb_methods`` of its kind)."""
        return [self.coulomb_methods[SYSTEM_KINDS[int(any(p))]] for p in self._periodic(batch)]

    # ---- forward ----------------------------------------------------------------------
    def forward(self, batch: Batch, compute_stress: bool = False) -> dict[str, torch.Tensor]:
        self.check_input(batch)
        charge = self.total_charge(batch)
        matrices = None
        if batch.neighbors is None:  # on a view: the caller's batch is left alone
            batch = Batch._from_dicts(dict(batch.node), dict(batch.system))
            matrices = self._kernel_matrices(batch)  # (matrices, images) or None
            if matrices is None:
                batch.neighbors = aimnet_kernel_neighbors(batch, self.cutoff, self._kernel_lists, self._open(batch))
            if matrices is None and batch.neighbors is None:
                from mlipdd.neighbors import attach_neighbors

                attach_neighbors(batch, self.cutoff)
        else:  # the caller's list, which may serve several calls (NOTE [matrices while the list holds])
            listed = self._list_matrices.get(batch, batch.positions, self.short_cutoff, self._long_cutoff(batch),
                                             self.cutoff, exact_long="ewald" in self.system_methods(batch))
            matrices = None if listed is None else (listed, None)
        positions = batch.positions
        with torch.enable_grad():
            if not positions.requires_grad:
                positions = positions.detach().requires_grad_(True)
            inputs, pos_used, cell = [positions], positions, batch.cell
            if compute_stress:
                strain = torch.zeros_like(batch.cell, requires_grad=True)
                inputs.append(strain)
                view = Batch._from_dicts({**batch.node, "positions": positions}, dict(batch.system))
                pos_used, cell = strained(view, strain)
            # float32, one process, no strain: DSF through aimnet's kernel, whose forces are
            # explicit (`coulomb.dsf_energy_and_forces`), for one system or many (each slot's
            # integer shifts with its system's cell). Not in float64: the kernel is 1e-9
            # (energy) and 5e-7 (forces) off the closed form there (measured)
            kernel = (not compute_stress and positions.dtype == torch.float32 and type(positions) is torch.Tensor
                      and OWNED_ROWS not in batch.node)
            energy, data = self._energy(batch, pos_used, cell, charge, matrices, dsf_kernel=kernel)
            grads = torch.autograd.grad(energy.sum(), inputs)
        if "_missing_pairs" in data:  # computed with the energy; no output leaves with pairs missing
            check_all_pairs(data["_missing_pairs"], self.method_cutoffs["simple"])
        # the energy stays float64 (a float32 total of ~1e5 eV rounds by ~1e-2 eV); forces,
        # stress and charges are in the batch's dtype
        out = {
            "energy": energy.detach(),
            "forces": -grads[0] + data["_dsf_forces"] if "_dsf_forces" in data else -grads[0],
            "charges": data["charges"].detach(),
        }
        if compute_stress:
            volume = torch.linalg.det(batch.cell).abs().view(-1, 1, 1)
            out["stress"] = grads[1] / volume
        return out

    def _long_cutoff(self, batch: Batch):
        """The Coulomb matrix's cutoff: one for all systems, one per system, or None."""
        if self.coulomb_cutoff is None:
            return None
        # each system's Coulomb matrix keeps the pairs its own method reads (a crystal next
        # to all-pairs molecules keeps its DSF-deep rows narrow)
        cutoffs = [self.method_cutoffs[m] for m in self.system_methods(batch)]
        if len(set(cutoffs)) == 1:
            return cutoffs[0]
        return torch.tensor(cutoffs, dtype=batch.positions.dtype, device=batch.positions.device)

    def _kernel_matrices(self, batch: Batch) -> tuple | None:
        """aimnet's matrices from nvalchemiops for a batch without a list (`own_neighbors`);
        None for per-system Coulomb cutoffs or where the kernel does not apply."""
        long_cutoff = self._long_cutoff(batch)
        if isinstance(long_cutoff, torch.Tensor):
            return None
        cutoffs = {"": self.short_cutoff, **({"_lr": long_cutoff} if long_cutoff is not None else {})}
        open_batch = self._open(batch)
        largest = invertible = None
        if open_batch:  # the atoms of the largest system (sizes the kernel's all-pairs matrix)
            largest = self._host.get("largest system", (batch.batch,), lambda: largest_system(batch))
        elif type(batch.positions) is torch.Tensor:  # one process: the wrap into the cell needs its inverse
            invertible = self._host.get("invertible cells", (batch.cell,), lambda: invertible_cells(batch))
        return aimnet_kernel_matrices(batch, cutoffs, self._kernel_lists, open_batch, largest, invertible)

    def _energy(self, batch: Batch, positions, cell, charge, matrices=None,
                dsf_kernel: bool = False) -> tuple[torch.Tensor, dict]:
        # ``matrices``: (matrices, images) from `_kernel_matrices`, or None (cut from the list)
        """Energy per system (network + the wrapper's Coulomb term) and aimnet's output dict
        (with ``_dsf_forces``, the forces autograd does not give, when ``dsf_kernel``)."""
        methods = self.system_methods(batch)
        data = aimnet_inputs(batch, positions, cell, charge, self.short_cutoff, self._long_cutoff(batch),
                             *(matrices or (None, None)), open_batch=self._open(batch))
        with explicit_convolution_rows():  # the Warp kernel's padding row is a real atom here
            data = self.model.forward_prepared(data)
        energy = data["energy"].to(torch.float64)
        for method, term in (("dsf", self._dsf_energy), ("simple", simple_energy), ("ewald", None)):
            if method not in methods:  # decided on the host: no device round trip per method
                continue
            # a batch of one method needs no mask (building one from the host waits for the device)
            chosen = (None if len(set(methods)) == 1 else
                      torch.tensor([m == method for m in methods], dtype=torch.float64, device=positions.device))
            if method == "simple":
                # read after the backward is queued (`forward`): a read here would stall the host
                # between the forward's kernels and the backward's
                data["_missing_pairs"] = missing_pairs(data, chosen)
            if method == "dsf" and dsf_kernel:
                dsf, forces = dsf_energy_and_forces(data, self.dsf_alpha, self.method_cutoffs["dsf"], cell)
                if chosen is None:  # every system: no mask (no extra launches)
                    energy, data["_dsf_forces"] = energy + dsf, forces
                else:  # a pair's two atoms are in one system: its force is its system's
                    energy = energy + dsf * chosen
                    data["_dsf_forces"] = forces * chosen.to(forces.dtype).index_select(0, batch.batch).unsqueeze(1)
            elif method == "ewald":
                on = torch.ones_like(energy) if chosen is None else chosen
                energy = energy + ewald_energy(data, batch, positions, cell, on, self.ewald_alpha,
                                               self.ewald_k_cutoff, self.method_cutoffs["ewald"])
            else:
                energy = energy + (term(data) if chosen is None else term(data) * chosen)
        return energy, data

    def _dsf_energy(self, data: dict) -> torch.Tensor:
        return dsf_energy(data, self.dsf_alpha, self.method_cutoffs["dsf"])

    def atomic_energies_and_charges(self, batch: Batch, positions, cell) -> tuple[torch.Tensor, torch.Tensor]:
        """(energy per atom, charges), both attached to ``positions``: the charge-model protocol
        of mlipdd-ewald-pme's ``ChargeCoupled``, which adds the Ewald/PME energy of these
        charges and differentiates the sum once.

        aimnet has no per-atom energy after its short-range Coulomb subtraction (a per-system
        term), so each atom carries an equal share of its system's energy: the per-system
        sums, and so energies, forces and stress, are exact; the shares are not site energies.
        The atom count is aimnet's own per-system sum, so it is right under DD as well.
        """
        if set(self.coulomb_methods.values()) != {"none"}:
            raise InputError(
                f"AIMNet2Wrapper(coulomb={self.coulomb!r}) already adds a Coulomb term; feeding its charges to "
                "another electrostatics model would count it twice: build it with coulomb='none'"
            )
        self.check_input(batch)
        energy, data = self._energy(batch, positions, cell, self.total_charge(batch))
        from aimnet import nbops

        index = batch.batch
        counts = nbops.mol_sum(torch.ones_like(data["charges"]), data)
        return (energy / counts)[index], data["charges"]

    # ---- compiled at several ranks (DomainConfig(compile=True)) ---------------------------
    @property
    def system_sums_over_ranks(self) -> bool:
        """Every per-system sum of this forward is aimnet's ``mol_sum``, which the adapter sends
        through `mlipdd.distributed.compiled_sums.system_sum`: so the core may compile it at
        several ranks. Not with Ewald (its reciprocal sum over each system's atoms is not a
        ``mol_sum``) or the all-pairs sum (every pair of a molecule: no ghost shell)."""
        return set(self.coulomb_methods.values()) <= {"dsf", "none"}

    @property
    def receptive_hop_lengths(self) -> tuple[float, ...]:
        """The hops an atom's energy reads, nearest first (the ghost shell compiled at several
        ranks: NOTE [deep ghost shell] in mlipdd.distributed.compiled_halo). Pass ``p`` of
        aimnet's ``P`` reads the neighbours' features of pass ``p - 1`` within ``rc_s``, so the
        energy network reads ``P`` hops and the charges ``P - 1``; the Coulomb term reads the
        charges within its cutoff, whose atoms read ``P - 1`` hops more."""
        passes = len(self.model.mlps)
        if self.coulomb_cutoff is None:
            return (self.short_cutoff,) * passes
        return (max(self.coulomb_cutoff, self.short_cutoff),) + (self.short_cutoff,) * (passes - 1)

    # ---- distribution -------------------------------------------------------------------
    def distribution_spec(self, strategy=None):
        """Sharded storage by default (see the plugin README for why); halo on request."""
        from mlipdd_aimnet2.spec import aimnet2_spec

        return aimnet2_spec(strategy)

    def extra_repr(self) -> str:
        return (f"cutoff={self.cutoff}, coulomb={self.coulomb!r}, charge={self.charge}, "
                f"species={list(self.species)}, dtype={self.dtype}")
