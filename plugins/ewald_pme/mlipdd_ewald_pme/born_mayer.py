"""Born-Mayer-Huggins repulsion for alkali halides: the short range of a molten-salt model.

``phi_ij(r) = b A_ij exp((s_i + s_j - r) / rho)``, shifted to zero at the cutoff, with the
Tosi-Fumi parameters for NaCl (J. Phys. Chem. Solids 25, 45 (1964)); the dispersion
terms are left out (the exponential alone keeps ions apart). Plain torch over the
neighbour list: halo work under domain decomposition.
"""

from __future__ import annotations

import torch
from mlipdd import Batch
from mlipdd.data import InputError
from mlipdd.models import ModelConfig, ModelWrapper, NeighborConfig

from mlipdd_ewald_pme.coulomb import edge_distances
from mlipdd_ewald_pme.spec import SPEC_EWALD_HALO

# b = 0.338e-19 J, rho = 0.317 A; Pauling factors A: ++ 1.25, +- 1.0, -- 0.75; radii (A)
TOSI_FUMI_NACL = {"b": 0.21096, "rho": 0.317, "radius": {11: 1.170, 17: 1.585},
                  "pauling": {(11, 11): 1.25, (11, 17): 1.0, (17, 17): 0.75}}


class BornMayerWrapper(ModelWrapper):
    """Pair repulsion between the species of ``params`` (default: Tosi-Fumi NaCl)."""

    def __init__(self, cutoff: float = 7.0, params: dict | None = None):
        super().__init__()
        params = params or TOSI_FUMI_NACL
        self.model_config = ModelConfig(NeighborConfig(float(cutoff)))
        species = sorted(params["radius"])
        self.species = tuple(species)
        table = torch.full((119,), -1, dtype=torch.long)
        table[torch.tensor(species)] = torch.arange(len(species))
        self.register_buffer("species_index", table)
        amplitude = torch.zeros(len(species), len(species), dtype=torch.float64)
        for (zi, zj), a in params["pauling"].items():
            i, j = species.index(zi), species.index(zj)
            ri, rj = params["radius"][zi], params["radius"][zj]
            amplitude[i, j] = amplitude[j, i] = params["b"] * a * torch.exp(torch.tensor((ri + rj) / params["rho"]))
        self.register_buffer("amplitude", amplitude)
        self.rho = float(params["rho"])

    def distribution_spec(self, strategy=None):
        return SPEC_EWALD_HALO.replace(name="born_mayer_halo")

    def atomic_energies(self, batch: Batch, positions, cell) -> torch.Tensor:
        index = self.species_index[batch.atomic_numbers]
        if bool((index < 0).any()):
            unknown = sorted(set(batch.atomic_numbers[index < 0].tolist()))
            raise InputError(f"BornMayerWrapper has no parameters for atomic numbers {unknown}; "
                             f"it knows {list(self.species)}: pass params= for other species")
        sender, receiver, d = edge_distances(batch, positions, cell)
        amplitude = self.amplitude.to(positions.dtype)[index[sender], index[receiver]]
        pair = amplitude * (torch.exp(-d / self.rho) - torch.exp(torch.tensor(-self.cutoff / self.rho)))
        pair = torch.where(d < self.cutoff, pair, torch.zeros_like(d))
        energies = torch.zeros(positions.shape[0], dtype=positions.dtype, device=positions.device)
        return energies.index_add(0, receiver, 0.5 * pair)
