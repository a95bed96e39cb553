"""Random-weight UMA models for tests and benchmarks.

No pretrained weights can be fetched here, so tests build the real fairchem classes
(`eSCNMDBackbone` + `MLP_EFS_Head` in a `HydraModelV2`) from a configuration dict
with seeded random weights. The head computes forces and stress by autograd exactly
as the released conservative UMA models do.
"""

from __future__ import annotations

import torch

TASKS = ("omat", "omol")


def tiny_uma_config() -> dict:
    """A very small eSCN-MD backbone (for tests on a shared 2-core machine)."""
    return {
        "sphere_channels": 8,
        "hidden_channels": 8,
        "edge_channels": 8,
        "num_distance_basis": 16,
        "lmax": 1,
        "mmax": 1,
        "num_layers": 2,
        "cutoff": 4.0,
        "max_neighbors": 300,
    }


def uma_bench_config() -> dict:
    """Benchmark size: 128 channels, lmax 2, 4 layers, 6 A cutoff, no mixture of experts."""
    return {
        "sphere_channels": 128,
        "hidden_channels": 128,
        "edge_channels": 128,
        "num_distance_basis": 64,
        "lmax": 2,
        "mmax": 2,
        "num_layers": 4,
        "cutoff": 6.0,
        "max_neighbors": 300,
    }


def uma_s_mole_config(num_experts: int = 32) -> dict:
    """`uma_bench_config` with UMA-S's mixture of linear experts (MoLE): ``num_experts``
    copies of every SO(2) convolution weight, mixed per system by a routing MLP that reads
    the system's composition and its charge/spin/task embedding (released UMA-S: 32)."""
    return {**uma_bench_config(), **mole_settings(num_experts)}


def mole_settings(num_experts: int) -> dict:
    """The `eSCNMDMoeBackbone` arguments that turn MoLE on, routed by composition as in UMA."""
    return {"num_experts": num_experts, "use_composition_embedding": True, "moe_layer_type": "pytorch"}


# Settings every random model shares: conservative forces and stress from autograd,
# the graph built inside forward with the input's own pbc (as fairchem's inference
# settings force), and the plain PyTorch execution backend.
_FIXED = {
    "otf_graph": True,
    "always_use_pbc": False,
    "direct_forces": False,
    "regress_forces": True,
    "regress_stress": True,
    "radius_pbc_version": 2,
    "use_dataset_embedding": True,
    "execution_mode": "general",
    "activation_checkpointing": False,
}


def random_uma(config: dict | None = None, seed: int = 0, tasks=TASKS, **overrides):
    """A fairchem `HydraModelV2` (eSCN-MD backbone + energy/forces/stress head), float32, eval.

    ``config`` is a dict of `eSCNMDBackbone` arguments (default `tiny_uma_config()`);
    ``overrides`` replace single entries. A config with ``num_experts`` > 0 (see
    `mole_settings`) builds fairchem's mixture-of-experts `eSCNMDMoeBackbone` instead. ``tasks`` become the backbone's dataset
    embeddings (UMA's task names: "omat", "omol", ...).
    """
    from fairchem.core.models.base import HydraModelV2
    from fairchem.core.models.uma.escn_md import MLP_EFS_Head, eSCNMDBackbone
    from fairchem.core.models.uma.escn_moe import eSCNMDMoeBackbone

    kwargs = {**tiny_uma_config(), **(config or {}), **overrides}
    kwargs = {**_FIXED, "dataset_mapping": {t: t for t in tasks}, **kwargs}
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        backbone = (eSCNMDMoeBackbone if kwargs.get("num_experts") else eSCNMDBackbone)(**kwargs)
        heads = {"energyandforcehead": MLP_EFS_Head(backbone)}
        model = HydraModelV2(backbone, heads)
        # random heads start near zero energy; a visible scale makes differences visible
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(2.0)
    finally:
        torch.set_default_dtype(previous)
    return model.float().eval()


def random_uma_wrapper(config: dict | None = None, seed: int = 0, task: str = "omat", **kwargs):
    """`UMAWrapper` around `random_uma(config, seed)`; module-level so partials pickle
    (the conformance kit rebuilds the model in every spawned rank from the same seed)."""
    from mlipdd_uma.wrapper import UMAWrapper

    return UMAWrapper(random_uma(config, seed=seed), task=task, **kwargs)
