"""Check a wrapper's CUDA-graph path on CPU: `EagerReplay` runs everything
``DomainConfig(cuda_graph=True)`` does (static inputs, edges trimmed to the cutoff, the
fixed-size padded list with its null edges, recapture decisions) except the capture: its
"replay" calls the model eagerly on the static inputs and writes the results into the
tensors recorded at "capture", as a graph replay rewrites its outputs. A wrapper that
gives null edges weight, or filters a padded list, fails here without a GPU.

    dm = DistributedModel(model, DomainConfig(cutoff=..., cuda_graph=True))
    with_eager_replay(dm)          # before the first call
"""

from __future__ import annotations

from mlipdd.distributed.cuda_graph import GraphedForceCall

__all__ = ["EagerReplay", "graphed_vs_eager_md", "with_eager_replay"]


class EagerReplay(GraphedForceCall):
    """`GraphedForceCall` whose capture is an eager call (see the module docstring)."""

    def _check(self, batch) -> None:
        pass  # any device

    def _record(self, inputs, compute_stress):
        outputs = self.call(inputs.batch, compute_stress)

        def replay():
            for name, value in self.call(inputs.batch, compute_stress).items():
                outputs[name].copy_(value)

        return replay, outputs


def with_eager_replay(dm):
    """Swap a graphed `DistributedModel`'s capture for `EagerReplay` (same settings); returns dm."""
    graphed = dm._graphed
    if graphed is None:
        raise ValueError("with_eager_replay needs a DistributedModel built with DomainConfig(cuda_graph=True)")
    dm._graphed = EagerReplay(graphed.call, headroom=graphed.headroom, warmup=graphed.warmup,
                              trim_to=graphed.trim_to)
    return dm


def graphed_vs_eager_md(eager, graphed, owned, mirror, velocities, steps: int, dt: float, stress_every: int = 0):
    """Yield ``(step, stress, eager_out, graphed_out)`` along a velocity-Verlet-like path
    driven by the eager forces; before each call the graphed model's batch (``mirror``)
    gets the eager batch's positions, so both see the same geometry, list rebuilds
    included. ``stress_every``: ask for the stress every so many steps (0: never)."""
    import torch

    for step in range(steps):
        stress = bool(stress_every) and step % stress_every == 0
        mirror.node["positions"] = owned.positions.clone()
        a = eager(owned, compute_stress=stress)
        b = graphed(mirror, compute_stress=stress)
        if not torch.equal(owned.atom_ids, mirror.atom_ids):
            raise AssertionError(f"step {step}: the two models own different atoms")
        yield step, stress, a, b
        velocities = velocities + dt * a["forces"]
        owned.node["positions"] = owned.positions + dt * velocities
