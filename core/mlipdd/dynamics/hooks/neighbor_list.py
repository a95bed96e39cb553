"""Keep ``batch.neighbors`` valid before every force evaluation."""

from __future__ import annotations

from mlipdd.dynamics.base import DynamicsStage


class NeighborListHook:
    """Rebuild the list through ``policy`` (a `mlipdd.neighbors.NeighborListPolicy`) when needed.

    The rebuild decision is rank-local (an atom here moved past skin/2) and is reduced
    through ``dynamics.reduce.any`` so that all ranks rebuild together.
    """

    stage = DynamicsStage.BEFORE_COMPUTE
    frequency = 1

    def __init__(self, policy):
        self.policy = policy

    @property
    def num_builds(self) -> int:
        return self.policy.num_builds

    def __call__(self, ctx, stage) -> None:
        batch = ctx.batch
        local = batch.neighbors is None or self.policy.needs_rebuild(batch)
        if ctx.dynamics.reduce.any(local):
            self.policy.build(batch)
