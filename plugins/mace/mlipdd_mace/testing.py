"""Random-weight MACE models for tests and benchmarks.

No pretrained weights can be fetched in CI, so every test builds a `ScaleShiftMACE`
from a configuration with seeded random weights. The architecture is the one mace's
own training script builds for ``--model=MACE`` (residual interactions, non-linear
last readout), so the code paths exercised are those of real foundation models.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def mace_medium_config() -> dict:
    """Architecture of a "medium" MACE (as in MACE-MP medium), for benchmarks.

    128x0e+128x1o hidden features, max_ell 3, correlation 3, 6 A cutoff, 2 layers.
    """
    return {
        "r_max": 6.0,
        "num_interactions": 2,
        "hidden_irreps": "128x0e+128x1o",
        "max_ell": 3,
        "correlation": 3,
    }


def random_mace(
    elements: Sequence[int] = (1, 6, 8),
    r_max: float = 4.0,
    num_interactions: int = 2,
    channels: int = 8,
    max_ell: int = 2,
    correlation: int = 2,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    hidden_irreps: str | None = None,
    avg_num_neighbors: float = 8.0,
    heads: Sequence[str] | None = None,
    scale_shift: bool = True,
):
    """A `mace.modules.ScaleShiftMACE` with seeded random weights, in eval mode.

    ``scale_shift=False`` builds the plain `mace.modules.MACE` base class instead.

    ``hidden_irreps`` defaults to ``{channels}x0e+{channels}x1o``; pass it to build
    e.g. `mace_medium_config()` (``random_mace(**mace_medium_config())``).
    """
    from e3nn import o3
    from mace import modules

    elements = sorted(int(z) for z in elements)
    if hidden_irreps is None:
        hidden_irreps = f"{channels}x0e+{channels}x1o"
    heads = list(heads) if heads else ["Default"]
    generator = np.random.default_rng(seed)
    # Per-element reference energies of a plausible size (eV), one row per head.
    atomic_energies = generator.uniform(-10.0, -1.0, size=(len(heads), len(elements)))
    if len(heads) == 1:
        atomic_energies = atomic_energies[0]

    # mace creates its buffers (r_max, constants of the e3nn layers) in the default
    # dtype, so build under float64 and convert once at the end.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(seed)
        common = {
            "r_max": float(r_max),
            "num_bessel": 8,
            "num_polynomial_cutoff": 5,
            "max_ell": max_ell,
            "interaction_cls": modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            "interaction_cls_first": modules.interaction_classes["RealAgnosticInteractionBlock"],
            "num_interactions": num_interactions,
            "num_elements": len(elements),
            "hidden_irreps": o3.Irreps(hidden_irreps),
            "MLP_irreps": o3.Irreps("16x0e"),
            "atomic_energies": atomic_energies,
            "avg_num_neighbors": avg_num_neighbors,
            "atomic_numbers": elements,
            "correlation": correlation,
            "gate": torch.nn.functional.silu,
            "radial_MLP": [16, 16],
            "heads": heads,
        }
        if scale_shift:
            model = modules.ScaleShiftMACE(
                atomic_inter_scale=[1.3] * len(heads),
                atomic_inter_shift=[0.2] * len(heads),
                **common,
            )
        else:
            model = modules.MACE(**common)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval()


def random_mace_wrapper(chunk_atoms: int | None = None, cueq: bool = False, **kwargs):
    """`MACEWrapper` around `random_mace(**kwargs)` (chunked when ``chunk_atoms`` is given;
    converted by mace's e3nn->cuEquivariance converter when ``cueq``).

    A module-level function, so ``functools.partial(random_mace_wrapper, seed=0)`` pickles:
    the conformance kit (`mlipdd.testing`) rebuilds the model inside each spawned rank,
    and the same seed gives every rank the same weights.
    """
    from mlipdd_mace.wrapper import MACEWrapper

    return MACEWrapper(random_mace(**kwargs), chunk_atoms=chunk_atoms, cueq=cueq)


def cueq_mace_wrapper(device: str = "cpu", conv_fusion: bool | None = None, chunk_atoms: int | None = None,
                      **kwargs):
    """`random_mace(**kwargs)` moved to ``device`` and converted there by mace's converter (on
    CUDA its convolutions are fused unless ``conv_fusion=False``), as a `MACEWrapper`."""
    from mlipdd_mace.wrapper import MACEWrapper

    return MACEWrapper(random_mace(**kwargs).to(device), chunk_atoms=chunk_atoms, cueq=True,
                       conv_fusion=conv_fusion)


class ReferenceFusedConvolution(torch.nn.Module):
    """cuEq's fused convolution (gather senders, channel-wise product, sum into receivers in
    one polynomial call, as mace builds it with ``conv_fusion`` on CUDA) evaluated by
    cuequivariance's torch reference kernels, so a CPU can run that calling convention.

    mace's own fused form needs the CUDA kernel's object to be built; this builds the same
    polynomial from the converted block's channel-wise product (same irreps, same weights
    from the block's radial MLP, ir_mul layout) and makes the same call.
    """

    def __init__(self, channelwise, dtype: torch.dtype):
        super().__init__()
        import cuequivariance as cue
        import cuequivariance_torch as cuet

        descriptor = cue.descriptors.channelwise_tensor_product(
            channelwise.irreps_in1, channelwise.irreps_in2, channelwise.irreps_out)
        self.polynomial = cuet.SegmentedPolynomial(
            descriptor.flatten_coefficient_modes().squeeze_modes().polynomial, method="naive",
            math_dtype=dtype)

    def forward(self, node_feats, edge_attrs, tp_weights, edge_index):
        sender, receiver = edge_index[0], edge_index[1]
        return self.polynomial([tp_weights, node_feats, edge_attrs], {1: sender}, {0: node_feats},
                               {0: receiver})[0]


def reference_fused_cueq_wrapper(**kwargs):
    """`cueq_mace_wrapper(**kwargs)` (CPU, unfused) with every convolution in the fused form
    (`ReferenceFusedConvolution`), flagged ``conv_fusion`` as mace flags its fused blocks."""
    from mlipdd_mace.wrapper import MACEWrapper

    model = cueq_mace_wrapper(**kwargs).model
    for block in model.interactions:
        block.conv_tp = ReferenceFusedConvolution(block.conv_tp, next(model.parameters()).dtype)
        block.conv_fusion = True
    return MACEWrapper(model)


# A small architecture for the cuEq tests: cuEq's reference kernels are built per layer when
# a model is converted (a few seconds each rank); max_ell 2, correlation 2, 8 channels keep
# that short.
SMALL_CUEQ_ARCH = {"elements": (1, 6, 8), "r_max": 4.0, "channels": 8, "max_ell": 2, "correlation": 2,
                   "dtype": torch.float64, "seed": 0}
COMPARED_OUTPUTS = ("energy", "forces", "stress", "energies")


def small_cueq_systems() -> dict:
    """A triclinic cell, a cell whose ranks see their own images and a slab, of H, C and O."""
    from mlipdd.testing.systems import slab, small_cell, triclinic

    species = SMALL_CUEQ_ARCH["elements"]
    return {
        "triclinic": triclinic(species=species, spacing=2.5, reps=4),
        "small_cell": small_cell(species=species, spacing=2.5, reps=2),
        "slab": slab(species=species, spacing=2.5, reps=(4, 4, 2), vacuum=6.0),
    }


def outputs_per_strategy(rank, world_size, model_factory, batches, strategies, device="cpu"):
    """Spawned-rank worker: one model per rank (a cuEq conversion is slow), then for each
    strategy and system one distributed forward with stress; owned forces, the replicated
    energy and stress, ghost rows read, and how often the cuEq row rules fired
    (`mlipdd_mace.cueq`), all on the CPU."""
    from mlipdd.distributed import DistributedModel, DomainConfig
    from mlipdd.testing.conformance import build_model
    from mlipdd_mace.cueq import FIRED

    model = build_model(model_factory, device)
    results = {}
    for strategy in strategies:
        for i, batch in enumerate(batches):
            before = sum(v for k, v in FIRED.items() if k.startswith("mace_cueq"))
            fused_before = FIRED["mace_cueq:fused_conv"]
            dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, strategy=strategy))
            owned = dm.partition(batch if rank == 0 else None, device=device)
            out = dm(owned, compute_stress=True)
            results[strategy, i] = {
                "atom_ids": owned.atom_ids.cpu(),
                "energy": out["energy"].detach().cpu(),
                "forces": out["forces"].detach().cpu(),
                "stress": out["stress"].detach().cpu(),
                "n_ghost": dm.strategy.report()["ghost_rows"],
                "cueq_rule_calls": sum(v for k, v in FIRED.items() if k.startswith("mace_cueq")) - before,
                "cueq_fused_calls": FIRED["mace_cueq:fused_conv"] - fused_before,
            }
    return results


def distributed_outputs_of_each(rank, world_size, model_factory, batches, compute_stress=True,
                                config_kwargs=None):
    """Spawned-rank worker: `mlipdd.testing.conformance.distributed_outputs` for several
    systems in one launch (a launch costs each rank a mace import); ``config_kwargs`` go
    to the `DomainConfig`."""
    from mlipdd.testing.conformance import distributed_outputs

    return [distributed_outputs(rank, world_size, model_factory, b, config_kwargs or {}, compute_stress)
            for b in batches]


def example_model(path: str | None, dtype: str = "float64", device="cpu"):
    """A `MACEWrapper` from a ``.model`` file, or a random-weight one (H, C, O) when
    ``path`` is None. The fixed seed gives every rank the same weights."""
    from mlipdd_mace.wrapper import MACEWrapper

    if path is not None:
        return MACEWrapper.from_file(path, device=device)
    model = random_mace(elements=(1, 6, 8), r_max=4.0, dtype=getattr(torch, dtype), seed=0)
    return MACEWrapper(model.to(device))


def example_system(structure: str | None, repeat: int, dtype, seed: int):
    """The last frame of ``structure`` (any ASE format), or rattled diamond carbon."""
    from mlipdd.data import Batch

    if structure is not None:
        batch = Batch.read(structure, index="-1")
    else:
        from ase.build import bulk

        atoms = bulk("C", "diamond", a=3.57, cubic=True).repeat(repeat)
        atoms.rattle(0.05, seed=seed)
        batch = Batch.from_ase(atoms)
    return batch.to(dtype=dtype)
