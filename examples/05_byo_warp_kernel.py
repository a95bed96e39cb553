"""Bring your own kernel: a Warp pair-energy kernel, made correct under domain decomposition
by one OpAdapter in the model's spec.

    python examples/05_byo_warp_kernel.py                        # validates on 2 spawned ranks, runs
    torchrun --nproc_per_node 2 examples/05_byo_warp_kernel.py   # runs on 2 ranks

The model's per-atom energies come out of a ``torch.library.custom_op`` whose body
launches a Warp kernel (forward) and a second one (backward, for forces and stress).
The kernel splits each edge's energy between BOTH ends of the edge, as kernels written
for half neighbour lists do. Under domain decomposition a ghost atom's row then holds
a share that belongs to an atom owned by another rank; ShardTensor dispatch cannot see
inside the kernel, so the spec says it: ``output_transforms={0: ScatterOutputs()}``
sends those shares home. Without that line the energy is wrong, and
``trace_and_validate`` names the op and this fix.

The kernels are generic in the float type and take the torch tensors' device, so the
same file runs on CPU (float64 here) and CUDA.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import warp as wp
from mlipdd import Batch
from mlipdd.distributed import DistributedManager, DistributedModel, DomainConfig
from mlipdd.lattices import fcc_argon
from mlipdd.models import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.spec import SPEC_MPNN_HALO, DistributionSpec, HaloStoragePolicy, MLIPSpec, OpAdapter
from mlipdd.spec.transforms import ScatterOutputs

wp.config.quiet = True
wp.init()

# ---- the kernels: phi(r) = eps exp(-r^2 / 2 sigma^2) (1 - r^2/rc^2)^2 for r < rc ------------


@wp.func
def _pair_terms(d2: Any, epsilon: Any, inv_two_sigma2: Any, inv_cutoff2: Any):
    """(phi, dphi/d(r^2)) of one pair; zero beyond the cutoff (lists may hold a skin)."""
    one = type(d2)(1.0)
    zero = type(d2)(0.0)
    t = one - d2 * inv_cutoff2
    if t <= zero:
        return zero, zero
    gauss = epsilon * wp.exp(-d2 * inv_two_sigma2)
    phi = gauss * t * t
    dphi = -inv_two_sigma2 * phi - type(d2)(2.0) * gauss * t * inv_cutoff2
    return phi, dphi


@wp.kernel
def _pair_energy_kernel(
    positions: wp.array(dtype=Any), shifts: wp.array(dtype=Any),
    senders: wp.array(dtype=wp.int64), receivers: wp.array(dtype=wp.int64),
    epsilon: Any, inv_two_sigma2: Any, inv_cutoff2: Any, energies: wp.array(dtype=Any),
):
    e = wp.tid()
    i = senders[e]
    j = receivers[e]
    vec = positions[j] + shifts[e] - positions[i]
    phi, _dphi = _pair_terms(wp.dot(vec, vec), epsilon, inv_two_sigma2, inv_cutoff2)
    # a full list holds each pair twice: a quarter of phi to each end, each time
    share = type(phi)(0.25) * phi
    wp.atomic_add(energies, i, share)
    wp.atomic_add(energies, j, share)


@wp.kernel
def _pair_energy_grad_kernel(
    positions: wp.array(dtype=Any), shifts: wp.array(dtype=Any),
    senders: wp.array(dtype=wp.int64), receivers: wp.array(dtype=wp.int64),
    epsilon: Any, inv_two_sigma2: Any, inv_cutoff2: Any, grad_energies: wp.array(dtype=Any),
    grad_positions: wp.array(dtype=Any), grad_shifts: wp.array(dtype=Any),
):
    e = wp.tid()
    i = senders[e]
    j = receivers[e]
    vec = positions[j] + shifts[e] - positions[i]
    phi, dphi = _pair_terms(wp.dot(vec, vec), epsilon, inv_two_sigma2, inv_cutoff2)
    weight = type(phi)(0.5) * (grad_energies[i] + grad_energies[j]) * dphi  # 0.25 * d(r^2)/dvec = 0.5 vec
    g = weight * vec
    wp.atomic_add(grad_positions, j, g)
    wp.atomic_sub(grad_positions, i, g)
    grad_shifts[e] = g


_VEC = {torch.float64: wp.vec3d, torch.float32: wp.vec3f}
_SCALAR = {torch.float64: wp.float64, torch.float32: wp.float32}


def _launch(kernel, positions, shifts, edge_index, params, *outputs_and_grads):
    dtype = positions.dtype
    if dtype not in _VEC:
        raise TypeError(f"gaussian_pair_energies runs in float32 or float64, not {dtype}")
    scalar = _SCALAR[dtype]
    epsilon, sigma, cutoff = params
    device = wp.device_from_torch(positions.device)
    stream = wp.stream_from_torch(positions.device) if device.is_cuda else None
    def view(t):  # Warp reads the buffer; autograd stays on the torch side
        return wp.from_torch(t.detach().contiguous(), dtype=_VEC[dtype] if t.dim() == 2 else None,
                             requires_grad=False)

    arrays = [view(positions), view(shifts), view(edge_index[0]), view(edge_index[1]),
              scalar(epsilon), scalar(0.5 / sigma**2), scalar(1.0 / cutoff**2)]
    arrays += [view(t) for t in outputs_and_grads]
    wp.launch(kernel, dim=edge_index.shape[1], inputs=arrays, device=device, stream=stream)


# ---- the custom op (what the model calls) --------------------------------------------------


@torch.library.custom_op("mlipdd_examples::gaussian_pair_energies", mutates_args=())
def gaussian_pair_energies(positions: torch.Tensor, shifts: torch.Tensor, edge_index: torch.Tensor,
                           epsilon: float, sigma: float, cutoff: float) -> torch.Tensor:
    """Per-atom energies (N,) of the Gaussian pair potential over a full neighbour list."""
    energies = positions.new_zeros(positions.shape[0])
    _launch(_pair_energy_kernel, positions, shifts, edge_index, (epsilon, sigma, cutoff), energies)
    return energies


@gaussian_pair_energies.register_fake
def _(positions, shifts, edge_index, epsilon, sigma, cutoff):
    return positions.new_empty(positions.shape[0])


def _save_inputs(ctx, inputs, output):
    positions, shifts, edge_index, *params = inputs
    ctx.save_for_backward(positions, shifts, edge_index)
    ctx.params = params


@torch.library.custom_op("mlipdd_examples::gaussian_pair_energies_backward", mutates_args=())
def gaussian_pair_energies_backward(grad_energies: torch.Tensor, positions: torch.Tensor, shifts: torch.Tensor,
                                    edge_index: torch.Tensor, epsilon: float, sigma: float,
                                    cutoff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the per-atom energies with respect to positions and shift vectors."""
    grad_positions = torch.zeros_like(positions)
    grad_shifts = torch.zeros_like(shifts)
    _launch(_pair_energy_grad_kernel, positions, shifts, edge_index, (epsilon, sigma, cutoff),
            grad_energies, grad_positions, grad_shifts)
    return grad_positions, grad_shifts


@gaussian_pair_energies_backward.register_fake
def _(grad_energies, positions, shifts, edge_index, epsilon, sigma, cutoff):
    return torch.empty_like(positions), torch.empty_like(shifts)


def _backward(ctx, grad_energies):
    # a kernel of its own (an op too, so torch.compile treats it as opaque); no double backward
    positions, shifts, edge_index = ctx.saved_tensors
    grad_positions, grad_shifts = gaussian_pair_energies_backward(
        grad_energies, positions, shifts, edge_index, *ctx.params)
    return grad_positions, grad_shifts, None, None, None, None


gaussian_pair_energies.register_autograd(_backward, setup_context=_save_inputs)


# ---- the model: single-process code; its spec holds the one distribution-aware line ---------


def warp_pair_spec() -> MLIPSpec:
    """SPEC_MPNN_HALO plus the OpAdapter: output 0 holds per-atom partials in ghost rows."""
    adapter = OpAdapter(op=torch.ops.mlipdd_examples.gaussian_pair_energies.default,
                        output_transforms={0: ScatterOutputs()})
    return SPEC_MPNN_HALO.replace(
        distribution=DistributionSpec(HaloStoragePolicy(), custom_ops=(adapter,)), name="warp_pair_halo"
    )


class WarpPairModel(ModelWrapper):
    """Gaussian pair potential evaluated by a Warp kernel; forces and stress by autograd."""

    def __init__(self, epsilon: float = 0.02, sigma: float = 2.5, cutoff: float = 6.0,
                 with_adapter: bool = True):
        super().__init__()
        self.epsilon, self.sigma = float(epsilon), float(sigma)
        self.with_adapter = with_adapter  # False only to show what goes wrong without it
        self.model_config = ModelConfig(NeighborConfig(float(cutoff)))

    def distribution_spec(self, strategy=None):
        return warp_pair_spec() if self.with_adapter else None

    def atomic_energies(self, batch: Batch, positions, cell):
        shifts = batch.neighbors.shifts(cell, batch.batch)
        return gaussian_pair_energies(positions, shifts, batch.neighbors.edge_index,
                                      self.epsilon, self.sigma, self.cutoff)


# ---- run it ---------------------------------------------------------------------------------


def validate_once(path: str) -> MLIPSpec:
    from mlipdd.validate import trace_and_validate

    # no sample given: validation builds one sized to the cutoff, so that no rank sees every atom
    report = trace_and_validate(WarpPairModel, world_size=2)
    print(report.summary())
    assert report.ok, report.next_action
    report.spec.save(path)  # the op is stored by name: "mlipdd_examples::gaussian_pair_energies"
    return report.spec


def main():
    rank = int(os.environ.get("RANK", "0"))
    spec_path = os.path.join(tempfile.gettempdir(), "warp_pair_spec.json")
    if rank == 0 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        validate_once(spec_path)  # spawns its own ranks; do it before joining a group
    with DistributedManager() as manager:
        # the saved spec (if this run validated one) or the model's own: the same content
        spec = MLIPSpec.load(spec_path) if os.path.exists(spec_path) else None
        model = WarpPairModel().to(manager.device)
        dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.5), spec=spec)
        full = None
        if manager.rank == 0:
            full = fcc_argon(5)
            noise = torch.randn(full.positions.shape, dtype=full.dtype, generator=torch.Generator().manual_seed(0))
            full.positions += 0.05 * noise  # seeded: 1 and N ranks print the same energy
        owned = dm.partition(full)
        out = dm(owned, compute_stress=True)
        print(f"rank {manager.rank}/{manager.world_size}: {owned.num_atoms} owned atoms, "
              f"energy {float(out['energy'][0]):.8f} eV, max |F| {float(out['forces'].norm(dim=1).max()):.6f} eV/A, "
              f"pressure {float(-out['stress'][0].diagonal().mean()):.3e} eV/A^3")


if __name__ == "__main__":
    main()
