"""Model wrappers: `EwaldWrapper`, `PMEWrapper`, `DSFWrapper`.

Each is an energy model (``atomic_energies``): the core sums the per-atom energies,
differentiates for forces and, through the strain, for stress. Charges are the batch's
node property ``charges`` (one per atom, in e), else fixed charges per element
(``element_charges={"Na": 1, "Cl": -1}``), or come from an upstream charge model
(see `ChargeCoupled`). Splitting parameters follow from ``cutoff`` and ``accuracy``:
``alpha = sqrt(-ln accuracy) / cutoff`` and ``k_cutoff = 2 alpha sqrt(-ln accuracy)``, so
the real-space and reciprocal-space truncation errors are both about ``accuracy``.

Slabs: with ``slab_correction=True`` Ewald and PME take a cell periodic along two axes with
``pbc`` False along the third, vacuum along it: the 3D sum over that cell plus the
Yeh-Berkowitz dipole term (`ewald.slab_energies`). The vacuum must be at least the cutoff
(no real-space pair crosses it) and about twice the slab's thickness for the usual ~1e-3
relative accuracy of the correction (the images' quadrupole and higher moments remain).
"""

from __future__ import annotations

import math

import torch
from mlipdd import Batch
from mlipdd.data import InputError
from mlipdd.models import ModelConfig, ModelWrapper, NeighborConfig

from mlipdd_ewald_pme import coulomb, ewald
from mlipdd_ewald_pme.spec import SPEC_DSF_HALO, SPEC_EWALD_HALO, SPEC_PME_HALO

CHARGES = "charges"
WARP_SPLINE_FLOOR = 1e-6  # below this accuracy PMEWrapper spreads with the plain-torch spline ops
MESH_LAYOUTS = ("replicated", "distributed")  # PMEWrapper(mesh=...): whole mesh per rank, or slabs


def element_charge_table(element_charges: dict | None) -> torch.Tensor | None:
    """``{"Na": 1, "Cl": -1}`` (symbols or atomic numbers) -> a (119,) lookup, NaN = unset."""
    if not element_charges:
        return None
    from ase.data import atomic_numbers

    table = torch.full((119,), float("nan"), dtype=torch.float64)
    for key, value in element_charges.items():
        z = atomic_numbers[key] if isinstance(key, str) and not key.isdigit() else int(key)
        table[z] = float(value)
    return table


def batch_charges(batch: Batch, model_name: str, by_element: torch.Tensor | None = None) -> torch.Tensor:
    """The node property ``charges`` (else charges by element, if given), or an error that
    says how to provide them."""
    charges = batch.node.get(CHARGES)
    if charges is None and by_element is not None:
        charges = by_element.to(batch.positions.device, batch.positions.dtype)[batch.atomic_numbers]
        if bool(torch.isnan(charges).any()):
            missing = sorted(set(batch.atomic_numbers[torch.isnan(charges)].tolist()))
            raise InputError(f"{model_name}: element_charges has no charge for atomic numbers {missing}; "
                             "add them, or give the batch a 'charges' node property")
        return charges
    if charges is None:
        raise InputError(
            f"{model_name} needs per-atom charges and the batch has none; add them with "
            "batch.add_node_property('charges', q) (one value per atom, in e), or feed them from "
            "a charge model with ChargeCoupled(charge_model, electrostatics)"
        )
    if charges.dim() != 1 or not charges.is_floating_point():
        raise InputError(
            f"{model_name}: node property 'charges' must be a 1-D float tensor (one charge per "
            f"atom), got shape {tuple(charges.shape)} and dtype {charges.dtype}"
        )
    return charges


def _vacuum_axes(batch: Batch, model_name: str, slab_correction: bool) -> torch.Tensor | None:
    """Per system, the axis without periodicity when ``slab_correction`` (else None), or
    an error naming the fix."""
    pbc = batch.pbc
    if pbc is None or bool(pbc.all()):
        if slab_correction:
            raise InputError(
                f"{model_name}(slab_correction=True) needs a slab: a cell periodic along two axes "
                "with pbc False along the vacuum axis; this batch is periodic along every axis"
            )
        return None
    open_axes = (~pbc).sum(1)
    if not slab_correction or bool((open_axes != 1).any()):
        raise InputError(
            f"{model_name} sums over periodic images in all three directions, but the batch is not "
            f"periodic along every axis (pbc={pbc.tolist()}); for a slab (one axis without periodicity, "
            f"vacuum along it) use {model_name}(slab_correction=True); for open systems use DSFWrapper "
            "(no reciprocal space)"
        )
    return (~pbc).to(torch.int64).argmax(1)


def _splitting(cutoff: float, accuracy: float, alpha: float | None) -> tuple[float, float]:
    if not 0.0 < accuracy < 1.0:
        raise InputError(f"accuracy must lie in (0, 1), got {accuracy}; 1e-6 is a common choice")
    log = math.sqrt(-math.log(accuracy))
    alpha = float(alpha) if alpha is not None else log / cutoff
    return alpha, 2 * alpha * log


class _Electrostatics(ModelWrapper):
    """Shared: charges lookup and the real-space + self + background terms."""

    spec = SPEC_EWALD_HALO

    def __init__(self, cutoff: float, accuracy: float, alpha: float | None, element_charges: dict | None,
                 slab_correction: bool = False):
        super().__init__()
        self.slab_correction = bool(slab_correction)
        self.by_element = element_charge_table(element_charges)
        self.alpha, self.k_cutoff = _splitting(float(cutoff), float(accuracy), alpha)
        self.accuracy = float(accuracy)
        self.model_config = ModelConfig(NeighborConfig(float(cutoff)))

    def distribution_spec(self, strategy=None):
        return self.spec

    def charges(self, batch: Batch) -> torch.Tensor:
        return batch_charges(batch, type(self).__name__, self.by_element)

    def atomic_energies(self, batch: Batch, positions, cell, charges=None) -> torch.Tensor:
        vacuum_axes = _vacuum_axes(batch, type(self).__name__, self.slab_correction)
        q = self.charges(batch) if charges is None else charges
        energies = (
            coulomb.ewald_real_space(batch, positions, cell, q, self.alpha, self.cutoff)
            + coulomb.ewald_self_energy(q, self.alpha)
            + ewald.background_energies(batch, cell, q, self.alpha)
            + self.reciprocal(batch, positions, cell, q)
        )
        if vacuum_axes is not None:  # the 3D sum over the cell with vacuum, then its dipole term off
            energies = energies + ewald.slab_energies(batch, positions, cell, q, vacuum_axes)
        return energies

    def reciprocal(self, batch, positions, cell, charges):
        raise NotImplementedError


class EwaldWrapper(_Electrostatics):
    """Ewald summation: erfc real space over the neighbour list + explicit k-space sum."""

    spec = SPEC_EWALD_HALO

    def __init__(self, cutoff: float = 10.0, accuracy: float = 1e-6, alpha: float | None = None,
                 element_charges: dict | None = None, slab_correction: bool = False):
        super().__init__(cutoff, accuracy, alpha, element_charges, slab_correction)

    def reciprocal(self, batch, positions, cell, charges):
        miller = ewald.miller_indices(batch.cell, self.k_cutoff)
        return ewald.reciprocal_energies(batch, positions, cell, charges, self.alpha, self.k_cutoff, miller)


class PMEWrapper(_Electrostatics):
    """Smooth particle-mesh Ewald: erfc real space + B-spline mesh reciprocal space.

    ``mesh_spacing=None`` sizes the mesh from the accuracy (NOTE [PME error estimate] in
    pme.py); a given spacing too coarse for the accuracy is refused. ``spline="warp"``
    spreads and gathers with nvalchemiops' kernels, which skip stencil weights below 1e-8
    (a floor near 1e-7 eV/A RMS force); ``spline="torch"`` uses plain-torch ops without
    that threshold (NOTE [spline floor]). The default picks Warp for ``accuracy >= 1e-6``
    in float64 and torch below, and torch in float32: nvalchemiops' float32 kernels miss by
    5e-4..1e-3 eV/A RMS force at any accuracy (NaCl), the torch ops in float32 reach ~3e-6.

    ``mesh="replicated"`` (the default) gives every rank the whole mesh: each spreads its own
    atoms, the meshes are all-reduced and every rank FFTs all of it. ``mesh="distributed"``
    splits each mesh over the ranks in slabs with a distributed FFT (`distributed_pme`,
    NOTE [mesh slabs] in slab_fft.py): mesh memory and FFT work per rank fall as 1/ranks.
    It spreads with its own B-splines, the torch ops' weights (so ``spline="warp"`` is
    refused there) and equals ``spline="torch"`` with a replicated mesh to rounding.
    """

    spec = SPEC_PME_HALO

    def __init__(self, cutoff: float = 10.0, accuracy: float = 1e-6, alpha: float | None = None,
                 mesh_spacing: float | None = None, spline_order: int = 6, element_charges: dict | None = None,
                 spline: str | None = None, slab_correction: bool = False, mesh: str = "replicated"):
        super().__init__(cutoff, accuracy, alpha, element_charges, slab_correction)
        if mesh not in MESH_LAYOUTS:
            raise InputError(f"mesh must be one of {MESH_LAYOUTS} (the whole mesh on every rank, or split "
                             f"over the ranks), got {mesh!r}")
        if mesh == "distributed" and spline not in (None, "torch"):
            raise InputError(f"PMEWrapper(mesh='distributed') spreads with its own B-splines (the weights of "
                             f"spline='torch'); spline={spline!r} has no distributed form: leave spline unset, "
                             "or use mesh='replicated'")
        self.mesh = mesh
        # registers the ops SPEC_PME_HALO names (a DD forward resolves them before running)
        from mlipdd_ewald_pme import pme  # noqa: F401

        if spline_order not in range(3, 7):
            raise InputError(f"spline_order must be 3..6 (the Warp kernels' range), got {spline_order}")
        self._spline_given = spline is not None
        if spline is None:  # the Warp kernels' floor (NOTE [spline floor]): ~1e-7 eV/A, more for large charges
            spline = "warp" if accuracy >= WARP_SPLINE_FLOOR else "torch"
        if spline not in ("warp", "torch"):
            raise InputError(f"spline must be 'warp' (nvalchemiops' kernels) or 'torch' (no weight threshold), "
                             f"got {spline!r}")
        self.mesh_spacing = mesh_spacing
        self.spline_order = int(spline_order)
        self.spline = spline

    def mesh_dimensions(self, cell: torch.Tensor) -> list[tuple[int, int, int]]:
        from mlipdd_ewald_pme import pme

        return [pme.mesh_dimensions(c, self.k_cutoff, self.spline_order, self.mesh_spacing, self.alpha) for c in cell]

    def reciprocal(self, batch, positions, cell, charges):
        from mlipdd_ewald_pme import pme  # Warp, through nvalchemiops: only where PME is used

        dims = self.mesh_dimensions(batch.cell)
        # NOTE [float32 splines]: nvalchemiops' float32 spread/gather are 5e-4..1e-3 eV/A off
        # (NaCl, every accuracy); the torch ops in float32 ~3e-6 eV/A, at the same speed on CPU
        spline = self.spline if self._spline_given or positions.dtype == torch.float64 else "torch"
        if self.mesh == "distributed":
            from mlipdd_ewald_pme import distributed_pme

            return distributed_pme.reciprocal_energies(batch, positions, cell, charges, self.alpha,
                                                       self.spline_order, dims)
        return pme.reciprocal_energies(batch, positions, cell, charges, self.alpha, self.spline_order, dims, spline)


class DSFWrapper(ModelWrapper):
    """Damped shifted force Coulomb: pairwise, for periodic and open systems alike."""

    def __init__(self, cutoff: float = 10.0, alpha: float = 0.2, element_charges: dict | None = None):
        super().__init__()
        self.by_element = element_charge_table(element_charges)
        self.alpha = float(alpha)
        self.model_config = ModelConfig(NeighborConfig(float(cutoff)))

    def distribution_spec(self, strategy=None):
        return SPEC_DSF_HALO

    def charges(self, batch: Batch) -> torch.Tensor:
        return batch_charges(batch, type(self).__name__, self.by_element)

    def atomic_energies(self, batch: Batch, positions, cell, charges=None) -> torch.Tensor:
        q = self.charges(batch) if charges is None else charges
        return (coulomb.dsf_pair_energy(batch, positions, cell, q, self.alpha, self.cutoff)
                + coulomb.dsf_self_energy(q, self.alpha, self.cutoff))
