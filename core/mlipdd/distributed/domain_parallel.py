"""`DomainParallel`: drive an unchanged integrator on this rank's subdomain.

    dyn = NVTLangevin(model, dt=2.0, temperature=300.0)
    with DomainParallel(dynamics=dyn, config=DomainConfig(cutoff=model.cutoff),
                        n_steps=1000, hooks=[TrajectoryWriter("md.extxyz")]) as dp:
        owned = dp.partition(full if rank == 0 else None)
        dp.run()

What it changes in the integrator, and why:

* the model becomes a `DistributedModel` (halo exchange; it builds one neighbour list per
  subdomain and migrates atoms at rebuilds, so the integrator's own `NeighborListHook`
  is removed: a full-system list would be wrong on a part of the system);
* ``dynamics.reduce`` becomes a `DistributedReducer`, so kinetic energy, temperature
  and every other global sum of any integrator are all-reduced over the group;
* hooks given here are scoped (see NOTE [hook scopes] in `mlipdd.distributed.hooks`);
  hooks given to the integrator itself run on the owned atoms;
* the decomposition is a stage of its own (`DecompositionStage`, the first hook at
  BEFORE_COMPUTE): one MD step is ::

      BEFORE_STEP -> pre_update (kick, drift) -> AFTER_POSITIONS
      -> BEFORE_COMPUTE: decomposition stage (inputs checked on every rank in one
         all-reduce with the rebuild vote; at a rebuild atoms migrate and the halo plan
         and local neighbour list are rebuilt), then the other BEFORE_COMPUTE hooks
      -> force call (the model on this rank's rows; no checks or planning inside)
      -> AFTER_COMPUTE -> post_update (kick) -> AFTER_STEP

Every step runs inside `fail_together`: an exception on one rank stops every rank
promptly with that rank's message, never a hang. The process group belongs to the
launcher (`DistributedManager`, torchrun); leaving the ``with`` block only closes the
hooks' files.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Self

from mlipdd.comm import OnGroup, broadcast_object, check_together, compute_on_rank0, fail_together
from mlipdd.data import Batch, InputError
from mlipdd.distributed.checkpoint import (
    Checkpoint,
    checkpoint_payload,
    load_checkpoint,
    restore_dynamics,
    write_atomically,
)
from mlipdd.distributed.config import DomainConfig
from mlipdd.distributed.hooks import (
    HookScope,
    ScopedHook,
    SnapshotCache,
    check_hook,
    default_scope,
    gather_batch,
)
from mlipdd.distributed.model import DistributedModel
from mlipdd.distributed.reducer import DistributedReducer
from mlipdd.dynamics.base import BaseDynamics, DynamicsStage


class DecompositionStage:
    """The MD step's decomposition stage: `DistributedModel.prepare` on the owned batch,
    every step and before the first force evaluation, on every rank (NOTE [decomposition
    stage] in `mlipdd.distributed.model`)."""

    stage = DynamicsStage.BEFORE_COMPUTE
    frequency = 1

    def __init__(self, model: DistributedModel):
        self.model = model

    def __call__(self, ctx, stage) -> None:
        self.model.prepare(ctx.batch)


class DomainParallel(OnGroup):
    """``DomainParallel(dynamics, config, n_steps=0, hooks=(), group=None, spec=None)``.

    ``dynamics``: any `BaseDynamics`; its model is wrapped in a `DistributedModel` built
    from ``config`` (or used as is when it already is one). ``hooks``: hooks or
    ``(hook, HookScope)`` pairs; a hook without an explicit scope uses its ``scope``
    attribute, else a default (`mlipdd.distributed.hooks.default_scope`).
    """

    def __init__(
        self,
        dynamics: BaseDynamics,
        config: DomainConfig | None = None,
        n_steps: int = 0,
        hooks=(),
        *,
        group=None,
        spec=None,
    ):
        if not isinstance(dynamics, BaseDynamics):
            raise InputError(
                f"DomainParallel wraps an integrator (a BaseDynamics such as NVE or NVTLangevin), "
                f"got {type(dynamics).__name__}"
            )
        model = dynamics.model
        if isinstance(model, DistributedModel):
            distributed = model
        else:
            if config is None:
                raise InputError(
                    "DomainParallel needs a DomainConfig to distribute the model; pass "
                    "config=DomainConfig(cutoff=model.cutoff)"
                )
            distributed = DistributedModel(model, config, spec=spec, group=group)
        self.dynamics = dynamics
        self.model = distributed
        self.config = distributed.config
        self.group = group
        self.n_steps = int(n_steps)
        self.batch: Batch | None = None
        self.scoped_hooks: list[ScopedHook] = []
        self._snapshots = SnapshotCache(group)
        self._closed = False

        from mlipdd.dynamics.hooks import NeighborListHook

        dynamics.model = distributed
        dynamics.reduce = DistributedReducer(group)
        dynamics.hooks = [h for h in dynamics.hooks if not isinstance(h, NeighborListHook)]
        dynamics.add_hook(DecompositionStage(distributed), first=True)
        for hook in hooks:
            if isinstance(hook, tuple):
                self.add_hook(*hook)
            else:
                self.add_hook(hook)

    # ---- identity -------------------------------------------------------------------------


    @property
    def strategy(self):
        return self.model.strategy

    @property
    def step_count(self) -> int:
        return self.dynamics.step_count

    # ---- hooks ----------------------------------------------------------------------------
    def add_hook(self, hook, scope: HookScope | str | None = None) -> ScopedHook:
        check_hook(hook)
        scope = HookScope(scope) if scope is not None else default_scope(hook)
        scoped = ScopedHook(hook, scope, self._snapshots)
        self.dynamics.add_hook(scoped)
        self.scoped_hooks.append(scoped)
        return scoped

    # ---- system ---------------------------------------------------------------------------
    def partition(self, full: Batch | None) -> Batch:
        """Rank 0 gives the full system (None elsewhere); returns this rank's owned atoms.

        The returned batch is updated in place as atoms migrate; keep using it.
        """
        with fail_together(self.group):
            self.batch = self.model.partition(full)
        self.dynamics.batch = None  # forces of the new layout are computed at the first step
        return self.batch

    def gather(self, to_all: bool = False) -> Batch | None:
        """Collective: the full system (id order) on rank 0, or on every rank with ``to_all``."""
        with fail_together(self.group):
            return gather_batch(self._owned(), self.group, to_all=to_all)

    def _owned(self) -> Batch:
        if self.batch is None:
            raise InputError(
                "no system yet: call partition(full_on_rank0_or_None) or restore(path) first"
            )
        return self.batch

    # ---- running --------------------------------------------------------------------------
    def run(self, n_steps: int | None = None) -> Batch:
        """Advance the owned batch by ``n_steps`` (default: the constructor's) on every rank."""
        n = self.n_steps if n_steps is None else int(n_steps)
        batch = self._owned()
        with fail_together(self.group):
            self.dynamics.run(batch, n)
        return batch

    def step(self) -> None:
        """One step (forces are evaluated first when the batch has none yet)."""
        batch = self._owned()
        with fail_together(self.group):
            if self.dynamics.batch is not batch or batch.forces is None:
                self.dynamics.setup(batch)
            self.dynamics.step()

    # ---- checkpoint -----------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path, run: dict | None = None) -> None:
        """Collective: gather the full state to rank 0, which writes ``path`` atomically
        (with the application's ``run`` record, `Checkpoint.run`, when given)."""
        with fail_together(self.group):
            full = gather_batch(self._owned(), self.group, to_all=False)
            compute_on_rank0(
                lambda: write_atomically(checkpoint_payload(full, self.dynamics, self.world_size, run), path),
                group=self.group,
            )

    def restore(self, path: str | Path) -> Batch:
        """Collective: rank 0 reads ``path``; the system is partitioned over this run's
        ranks (any number) and the integrator state restored. Returns the owned batch."""
        with fail_together(self.group):
            checkpoint = compute_on_rank0(load_checkpoint, path, group=self.group)
            header = broadcast_object(
                None
                if checkpoint is None
                else (
                    checkpoint.dynamics_class,
                    checkpoint.dynamics_state,
                    checkpoint.world_size,
                    checkpoint.dynamics_settings,
                    checkpoint.run,
                ),
                self.group,
            )
            owned = self.partition(None if checkpoint is None else checkpoint.batch)
            state = Checkpoint(owned, *header)
            device = owned.device
            self.dynamics.batch = None
            check_together(restore_dynamics, self.dynamics, state, device=device, group=self.group)
        return owned

    # ---- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Close the hooks' files (trajectory, logs). The process group is left alone."""
        if self._closed:
            return
        self._closed = True
        for scoped in self.scoped_hooks:
            try:
                scoped.close()
            except Exception as exc:  # noqa: BLE001 - teardown must reach every hook
                warnings.warn(f"closing hook {scoped!r} failed: {exc}", stacklevel=2)
        self._snapshots.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

