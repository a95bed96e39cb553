"""Presets of the electrostatics (and dispersion) wrappers.

Ewald and DSF are plain torch: halo storage does everything (real space reads ghost
rows; the structure factor is a per-system sum the dispatch all-reduces). PME adds
three opaque ops, declared here and nowhere else:

* ``nvalchemiops::spline_spread``: each rank spreads its owned atoms (``SliceOwned``
  on positions and charges), the partial meshes are summed (``AllReduceSum``);
* ``mlipdd_ewald_pme::mesh_potential``: no transform; its replicated mesh argument
  becomes this rank's copy (the core sums that argument's gradient over ranks);
* ``nvalchemiops::spline_gather``: no transform; it reads the potential at every
  ``[owned | ghost]`` row;
* ``mlipdd_ewald_pme::spline_spread`` / ``::spline_gather``: the plain-torch spline ops
  (``PMEWrapper(spline="torch")``, no weight threshold), under the same rules.

D3 has one: ``mlipdd_ewald_pme::d3_pair_c6`` (edge rows in, edge rows out, no transform).

The ops are named by string, so building a spec imports neither Warp nor nvalchemiops.
"""

from __future__ import annotations

from mlipdd.spec import (
    SPEC_MPNN_HALO,
    AllReduceSum,
    DistributionSpec,
    HaloStoragePolicy,
    OpAdapter,
    SliceOwned,
)

SPREAD_ADAPTER = OpAdapter(
    "nvalchemiops::spline_spread",
    arg_transforms={0: SliceOwned(), 1: SliceOwned()},
    output_transforms={0: AllReduceSum()},
)
POTENTIAL_ADAPTER = OpAdapter("mlipdd_ewald_pme::mesh_potential")
GATHER_ADAPTER = OpAdapter("nvalchemiops::spline_gather")
# the plain-torch spline ops (PMEWrapper(spline="torch"), no weight threshold): same rules
TORCH_SPREAD_ADAPTER = OpAdapter(
    "mlipdd_ewald_pme::spline_spread",
    arg_transforms={0: SliceOwned(), 1: SliceOwned()},
    output_transforms={0: AllReduceSum()},
)
TORCH_GATHER_ADAPTER = OpAdapter("mlipdd_ewald_pme::spline_gather")

SPEC_EWALD_HALO = SPEC_MPNN_HALO.replace(name="ewald_halo")
"""Ewald summation: halo real space, structure factor reduced by the per-system sums."""

SPEC_DSF_HALO = SPEC_MPNN_HALO.replace(name="dsf_halo")
"""Damped shifted force: a pair potential, halo only."""

SPEC_PME_HALO = SPEC_MPNN_HALO.replace(
    distribution=DistributionSpec(
        HaloStoragePolicy(),
        custom_ops=(SPREAD_ADAPTER, POTENTIAL_ADAPTER, GATHER_ADAPTER, TORCH_SPREAD_ADAPTER, TORCH_GATHER_ADAPTER),
    ),
    name="pme_halo",
)
"""Particle-mesh Ewald: halo real space; owned charges spread, mesh all-reduced."""

# D3's chunked C6 op reads and returns edge rows only: no transform (NOTE [chunked D3 pairs])
D3_C6_ADAPTER = OpAdapter("mlipdd_ewald_pme::d3_pair_c6")

SPEC_DFTD3_HALO = SPEC_MPNN_HALO.replace(
    distribution=DistributionSpec(HaloStoragePolicy(), custom_ops=(D3_C6_ADAPTER,)),
    name="dftd3_halo",
)
"""DFT-D3(BJ): coordination numbers are halo-corrected scatters, the pair sum is halo work."""

PRESETS = {
    "SPEC_DFTD3_HALO": SPEC_DFTD3_HALO,
    "SPEC_EWALD_HALO": SPEC_EWALD_HALO,
    "SPEC_PME_HALO": SPEC_PME_HALO,
    "SPEC_DSF_HALO": SPEC_DSF_HALO,
}
