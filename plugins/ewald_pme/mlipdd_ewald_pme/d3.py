"""DFT-D3(BJ) dispersion (two-body, optional three-body ATM) as a model wrapper, in plain torch.

    CN_i  = sum_j 1 / (1 + exp(-16 (R_cov,i + R_cov,j) / r_ij + 16))          (r_ij < cutoff)
    C6_ij = sum_ab w_ia w_jb C6ref(Z_i, Z_j)_ab,   w_ia ~ exp(-4 (CN_i - CNref_ia)^2), normalised
    E     = -1/2 sum_ij [s6 C6 / (r^6 + R0^6) + s8 C8 / (r^8 + R0^8)] S(r),  C8 = 3 C6 Q_i Q_j,
            R0 = a1 sqrt(3 Q_i Q_j) + a2                                     (r_ij < cutoff)
    S     = 1, or a quintic switch from ``switch_on`` to the cutoff

The reference tables (C6ref, CNref, covalent radii, Q = sqrt(<r^4>/<r^2>) scaled) are
Grimme's D3 reference as shipped by tad-dftd3 (nvalchemiops 0.5.0 ships none: its
``dftd3`` kernel needs a user-supplied parameter file). The three-body (ATM) term is in
`mlipdd_ewald_pme.three_body` (``params={"s9": 1.0}``).

Domain decomposition: the coordination numbers are an ``index_add`` into atom rows, so
the halo dispatch gives every ghost row its owner's complete CN (a two-layer
message-passing network, as far as distribution goes); one halo of ``cutoff`` suffices.
Units: Angstrom and eV outside; Bohr and Hartree inside, as the reference tables are.
"""

from __future__ import annotations

import torch
from mlipdd import Batch
from mlipdd.data import InputError
from mlipdd.models import ModelConfig, ModelWrapper, NeighborConfig

from mlipdd_ewald_pme.d3_c6 import DEFAULT_CHUNK, pair_c6
from mlipdd_ewald_pme.spec import SPEC_DFTD3_HALO

BOHR = 0.529177210903  # Angstrom
HARTREE = 27.211386245988  # eV
# memory_estimate's coefficients (per edge: integer bytes, floats; per chunked edge: 7x7 blocks)
EDGE_INDEX_BYTES, EDGE_FLOATS, CHUNK_FLOATS = 24, 40, 2
PBE_BJ = {"s6": 1.0, "a1": 0.4289, "s8": 0.7875, "a2": 4.4407}  # a2 in Bohr (Grimme 2011)


def reference_tables(dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Grimme's D3 reference data (from tad-dftd3), indexed by atomic number."""
    from tad_dftd3 import data
    from tad_dftd3.reference import Reference
    from tad_mctc.data import radii

    ref = Reference(dtype=dtype, device=torch.device("cpu"))
    return {"c6": ref.c6, "cn": ref.cn, "rcov": radii.COV_D3(dtype=dtype), "r4r2": data.R4R2(dtype=dtype),
            "rvdw": radii.VDW_PAIRWISE(dtype=dtype)}  # zero-damping radii (Bohr), for the ATM term


def reference_weights(cn: torch.Tensor, cn_ref: torch.Tensor) -> torch.Tensor:
    """Normalised Gaussian weights ``exp(-4 (CN - CNref_a)^2) / sum_b exp(-4 (CN - CNref_b)^2)``.

    ``cn_ref`` is (N, 7) with ``CNref < 0`` marking an unused slot. Written as a softmax
    over the exponents (the largest is subtracted before exponentiating), so the weights
    never all underflow: an atom whose CN lies far above its element's largest reference
    (Mg in rock-salt MgO reaches 16.4 against 1.95; every ``exp`` is 0 in float64, and
    0 / 0 was NaN) gets all its weight on the highest-CN reference, which is what
    simple-dftd3 and tad-dftd3 fall back to there. Where nothing underflows this is the
    plain quotient to rounding; near the fallback the next reference's share is
    ``exp(-4 (2 CN - CN_a - CN_b)(CN_a - CN_b))``, below 1e-12 for every element of the
    table (closest top pair: Ni, 6.29 and 6.55) by the time the reference codes switch.
    Smooth everywhere, and the same in float32 (whose ``exp`` underflows already at
    ``|CN - CNref| > 5``).
    """
    exponents = -4.0 * (cn.unsqueeze(1) - cn_ref).square()
    exponents = torch.where(cn_ref >= 0, exponents, torch.full_like(exponents, float("-inf")))
    return torch.softmax(exponents, dim=1)


class D3Wrapper(ModelWrapper):
    """DFT-D3(BJ) with damping parameters ``s6, a1, s8, a2`` (default PBE), ``s9`` for the
    three-body ATM term (default 0: two-body only, as aimnet's D3 and D3(BJ) without "-ATM";
    1.0 is D3(BJ)-ATM, `mlipdd_ewald_pme.three_body`).

    ``cutoff`` bounds the coordination numbers and the pair sum; ``three_body_cutoff``
    (default ``cutoff``, at most it) the ATM triples. ``switch_on`` (A, below ``cutoff``)
    multiplies each pair energy by the quintic switch ``1 - 10 t^3 + 15 t^4 - 6 t^5``,
    ``t = (r - switch_on) / (cutoff - switch_on)``, so energy and force reach zero smoothly at
    the cutoff (the coordination numbers are not switched); released AIMNet2 models use
    ``cutoff=15.0, switch_on=12.0``, as aimnet's own D3 does. None: a hard cutoff.

    ``chunk``: edges per block of the pairs' C6 sums (NOTE [chunked D3 pairs]); memory
    falls with it, the result does not change. `memory_estimate` says what a call needs.
    """

    def __init__(self, cutoff: float = 10.0, params: dict | None = None, three_body_cutoff: float | None = None,
                 switch_on: float | None = None, chunk: int = DEFAULT_CHUNK):
        super().__init__()
        if int(chunk) < 1:
            raise InputError(f"chunk (edges per C6 block, NOTE [chunked D3 pairs]) must be >= 1, got {chunk}")
        self.chunk = int(chunk)
        self.model_config = ModelConfig(NeighborConfig(float(cutoff)))
        self.params = {**PBE_BJ, "s9": 0.0, **(params or {})}
        self.three_body_cutoff = float(cutoff if three_body_cutoff is None else three_body_cutoff)
        if not 0.0 < self.three_body_cutoff <= float(cutoff):
            raise InputError(f"three_body_cutoff must lie in (0, cutoff={cutoff}], got {three_body_cutoff}: the "
                             "triples are built from the pair term's neighbour list")
        if switch_on is not None and not 0.0 <= float(switch_on) < float(cutoff):
            raise InputError(f"switch_on must lie in [0, cutoff={cutoff}), got {switch_on}; None for a hard cutoff")
        self.switch_on = None if switch_on is None else float(switch_on)
        for name, table in reference_tables().items():
            self.register_buffer(name, table)

    def distribution_spec(self, strategy=None):
        return SPEC_DFTD3_HALO

    def _edges(self, batch: Batch, positions, cell):
        z = batch.atomic_numbers
        if bool((z >= self.cn.shape[0]).any()):
            raise InputError(f"D3Wrapper has reference data up to Z={self.cn.shape[0] - 1}; "
                             "remove heavier elements or use another dispersion model")
        nl = batch.neighbors
        sender, receiver = nl.edge_index
        vectors = (positions[sender] - positions[receiver] - nl.shifts(cell, batch.batch)) / BOHR
        d = vectors.norm(dim=1)
        inside = d < self.cutoff / BOHR
        safe = torch.where(inside, d, torch.ones_like(d))  # Bohr; 1 off the cutoff
        return z, sender, receiver, inside, safe, vectors

    def _coordination(self, z, sender, receiver, inside, safe, n_rows: int):
        # complete on every [owned | ghost] row under DD (halo-corrected scatter)
        r0 = (self.rcov[z[sender]] + self.rcov[z[receiver]]).to(safe.dtype)  # float64 tables, float32 inputs
        count = torch.where(inside, 1.0 / (1.0 + torch.exp(-16.0 * (r0 / safe - 1.0))), torch.zeros_like(safe))
        cn = torch.zeros(n_rows, dtype=safe.dtype, device=safe.device)
        return cn.index_add(0, receiver, count)

    def coordination_numbers(self, batch: Batch, positions=None, cell=None) -> torch.Tensor:
        """D3 coordination number of every atom (the exponential counting function)."""
        if batch.neighbors is None:
            from mlipdd.neighbors import attach_neighbors

            batch = batch.clone()
            attach_neighbors(batch, self.cutoff)
        positions = batch.positions if positions is None else positions
        cell = batch.cell if cell is None else cell
        z, sender, receiver, inside, safe, _ = self._edges(batch, positions, cell)
        return self._coordination(z, sender, receiver, inside, safe, positions.shape[0])

    @staticmethod
    def memory_estimate(n_atoms: int, n_edges: int, dtype=torch.float32, chunk: int = DEFAULT_CHUNK) -> int:
        """Bytes one two-body call (energy, forces, stress) needs above its batch and neighbour
        list: per edge ``EDGE_INDEX_BYTES`` of integer rows plus ``EDGE_FLOATS`` values of
        ``dtype`` (distances, counting terms, the two ends' weights and their gradients,
        what autograd keeps), one C6 chunk's blocks, and the per-atom tables (measured:
        benchmarks/results/d3_memory_*.md). The three-body term is not counted."""
        size = torch.finfo(dtype).bits // 8
        per_edge = EDGE_INDEX_BYTES + EDGE_FLOATS * size
        return int(n_edges * per_edge + CHUNK_FLOATS * min(chunk, n_edges) * 49 * size + n_atoms * 64 * size)

    def _switch(self, r_bohr: torch.Tensor) -> torch.Tensor:
        """The quintic switch (1 below ``switch_on``, 0 at the cutoff), or 1 without one."""
        if self.switch_on is None:
            return torch.ones_like(r_bohr)
        t = ((r_bohr * BOHR - self.switch_on) / (self.cutoff - self.switch_on)).clamp(0.0, 1.0)
        return 1.0 - t**3 * (10.0 - 15.0 * t + 6.0 * t * t)

    def atomic_energies(self, batch: Batch, positions, cell) -> torch.Tensor:
        z, sender, receiver, inside, safe, vectors = self._edges(batch, positions, cell)
        cn = self._coordination(z, sender, receiver, inside, safe, positions.shape[0])
        dtype = safe.dtype  # the tables are float64: read them in the inputs' dtype (float32 runs)
        weights = reference_weights(cn, self.cn[z].to(dtype))
        weights_sender = weights[sender]
        n_z = self.c6.shape[0]
        table = self.c6.to(dtype).reshape(n_z * n_z, *self.c6.shape[2:])  # NOTE [chunked D3 pairs]
        c6 = pair_c6(weights_sender, weights[receiver], z[sender] * n_z + z[receiver], table, self.chunk)
        qq = (3.0 * self.r4r2[z[sender]] * self.r4r2[z[receiver]]).to(dtype)
        p = self.params
        radius = p["a1"] * torch.sqrt(qq) + p["a2"]
        pair = p["s6"] * c6 / (safe**6 + radius**6) + p["s8"] * c6 * qq / (safe**8 + radius**8)
        pair = torch.where(inside, pair * self._switch(safe), torch.zeros_like(pair))
        energies = torch.zeros_like(cn)
        energies = energies.index_add(0, receiver, -0.5 * HARTREE * pair)
        if p["s9"] != 0.0:
            from mlipdd_ewald_pme.three_body import atm_energies

            three = atm_energies(positions, receiver, vectors, c6, weights_sender, z[sender], z[receiver],
                                 self.c6.to(dtype), self.rvdw.to(dtype), self.three_body_cutoff / BOHR, float(p["s9"]))
            energies = energies + HARTREE * three
        return energies
