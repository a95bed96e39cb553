"""Hook scopes under domain decomposition: what batch a hook on `DomainParallel` sees.

# NOTE [hook scopes]
Each rank holds only its owned atoms. A hook registered on the outer `DomainParallel`
declares (or is given) a scope:

* ``LOCAL``: called on every rank with the owned batch and the real integrator, whose
  reducer makes every global quantity (kinetic energy, temperature) correct. Cheap:
  nothing is gathered. Thermo logs and progress bars run here.
* ``RANK_ZERO``: the full system is gathered to rank 0 in global atom-id order and the
  hook is called there only. Trajectory and checkpoint writers run here.
* ``GLOBAL``: the full system is gathered to every rank and the hook runs everywhere on
  identical data, so a custom global quantity it computes stays in lockstep.

A gathered hook sees a *view* of the integrator: its ``batch`` is the gathered system
and its ``reduce`` is the identity (the data is already whole), so single-process hooks
such as `ThermoLogger` or `TrajectoryWriter` work unchanged. The gathered batch also
carries ``unwrapped_positions`` (positions + image counts @ cell) when atoms have been
wrapped by migration.
"""

from __future__ import annotations

import enum
import inspect

import torch

from mlipdd.comm import all_gather_objects, gather_objects, group_rank
from mlipdd.data import Batch, InputError
from mlipdd.dynamics.base import HookContext, hook_stages
from mlipdd.dynamics.hooks.trajectory import unwrapped_positions
from mlipdd.dynamics.reduce import GlobalReducer


class HookScope(str, enum.Enum):
    LOCAL = "local"
    RANK_ZERO = "rank_zero"
    GLOBAL = "global"



# ---- gathering ----------------------------------------------------------------------------
def gather_rows(atom_ids: torch.Tensor, rows: torch.Tensor, group=None) -> torch.Tensor | None:
    """Collective: every rank's owned ``rows`` (e.g. forces) in global atom-id order on
    rank 0 (None elsewhere), on the CPU; for checks and output, not for the hot path."""
    parts = gather_objects((atom_ids.detach().cpu(), rows.detach().cpu()), group)
    if parts is None:
        return None
    full = rows.new_empty((sum(len(ids) for ids, _ in parts), *rows.shape[1:]), device="cpu")
    for ids, part in parts:
        full[ids] = part
    return full


def gather_batch(batch: Batch, group=None, to_all: bool = False) -> Batch | None:
    """The full system from every rank's owned atoms, sorted by global atom id.

    Collective. ``to_all=False`` returns it on rank 0 only (None elsewhere); ``True`` on
    every rank. System properties (cell, energy, stress) are replicated, so rank-local
    ones are kept. Single-process it returns an id-sorted copy.
    """
    node = {k: v.detach() for k, v in batch.node.items() if torch.is_tensor(v)}
    mine = {k: v.cpu() for k, v in node.items()}
    parts = all_gather_objects(mine, group) if to_all else gather_objects(mine, group)
    if parts is None:
        return None
    keys = list(parts[0])
    if any(set(p) != set(keys) for p in parts):
        raise InputError(
            "ranks hold different per-atom fields "
            f"({sorted(set().union(*[set(p) for p in parts]) - set(keys))}); set a node property on "
            "every rank (e.g. in a LOCAL hook that runs everywhere), not on one rank only"
        )
    merged = {k: torch.cat([p[k] for p in parts]).to(batch.device) for k in keys}
    order = torch.argsort(merged["atom_ids"])
    full = Batch._from_dicts(
        {k: v.index_select(0, order) for k, v in merged.items()},
        {k: v.detach() if torch.is_tensor(v) else v for k, v in batch.system.items()},
    )
    if "image" in full.node:
        full.node["unwrapped_positions"] = unwrapped_positions(full)
    return full


class GatheredReducer(GlobalReducer):
    """Reductions on an already-gathered (whole) system: the identity; ``is_root`` is rank 0."""

    def __init__(self, is_root: bool):
        self._is_root = bool(is_root)

    @property
    def is_root(self) -> bool:
        return self._is_root


class DynamicsView:
    """The integrator as a gathered hook sees it: same state, but ``batch`` is the gathered
    system and ``reduce`` the identity. Methods run with ``self`` = this view, so
    ``view.kinetic_energy()`` sums the gathered velocities with no collective call."""

    def __init__(self, dynamics, batch: Batch, reduce: GlobalReducer):
        object.__setattr__(self, "wrapped_dynamics", dynamics)
        object.__setattr__(self, "batch", batch)
        object.__setattr__(self, "reduce", reduce)

    @property
    def __class__(self):
        # The integrator's methods run with self = this view; a zero-argument super() in
        # them (NVTLangevin.conserved_energy) checks isinstance(self, NVTLangevin), which
        # falls back to __class__. Report the integrator's class so that check passes.
        return type(object.__getattribute__(self, "wrapped_dynamics"))

    def __getattr__(self, name):
        inner = object.__getattribute__(self, "wrapped_dynamics")
        try:
            static = inspect.getattr_static(type(inner), name)
        except AttributeError:
            return getattr(inner, name)
        if name in inner.__dict__:  # an instance attribute wins over a plain class one
            return inner.__dict__[name]
        if hasattr(static, "__get__"):  # method, property, classmethod: bound to the view
            return static.__get__(self, type(inner))
        return static

    def __setattr__(self, name, value) -> None:
        setattr(self.wrapped_dynamics, name, value)


# ---- scoped hooks -------------------------------------------------------------------------
class SnapshotCache:
    """One gather per (stage, step, scope), shared by all scoped hooks of a `DomainParallel`.

    The snapshot is reused only while the owned positions and velocities are the very
    same tensors, so a LOCAL hook that changed them in between causes a fresh gather.
    """

    def __init__(self, group=None):
        self.group = group
        self._key = None
        self._value = None

    def get(self, ctx: HookContext, stage, to_all: bool) -> Batch | None:
        batch = ctx.batch
        key = (stage, ctx.step, to_all, batch.node.get("positions"), batch.node.get("velocities"))
        if self._key is not None and _same_key(self._key, key):
            return self._value
        self._value = gather_batch(batch, self.group, to_all=to_all)
        self._key = key
        return self._value

    def clear(self) -> None:
        self._key = self._value = None


def _same_key(a, b) -> bool:
    return a[:3] == b[:3] and a[3] is b[3] and a[4] is b[4]


class ScopedHook:
    """Adapts an outer hook to the inner integrator: same stage(s) and frequency, and the
    batch of its scope (see NOTE [hook scopes]). Every rank runs this adapter, so the
    gathers (collectives) happen on every rank in the same order."""

    def __init__(self, hook, scope: HookScope, cache: SnapshotCache):
        self.hook = hook
        self.scope = HookScope(scope)
        self.cache = cache
        self.stage = hook.stage
        self.frequency = int(hook.frequency)

    def __call__(self, ctx: HookContext, stage) -> None:
        if self.scope is HookScope.LOCAL:
            self.hook(ctx, stage)
            return
        to_all = self.scope is HookScope.GLOBAL
        full = self.cache.get(ctx, stage, to_all)
        is_root = group_rank(self.cache.group) == 0
        if full is None:  # RANK_ZERO, not rank 0
            return
        view = DynamicsView(ctx.dynamics, full, GatheredReducer(is_root))
        self.hook(HookContext(full, ctx.step, view), stage)

    def close(self) -> None:
        close = getattr(self.hook, "close", None)
        if callable(close):
            close()

    def __repr__(self) -> str:
        return f"ScopedHook({self.hook!r}, {self.scope.value})"


def default_scope(hook) -> HookScope:
    """The hook's own ``scope`` attribute, else the shipped hooks' natural scope, else
    RANK_ZERO (a hook written for one process then sees the whole system, never a part)."""
    from mlipdd.dynamics.hooks import NeighborListHook, ProgressBar, ThermoLogger

    declared = getattr(hook, "scope", None)
    if declared is not None:
        return HookScope(declared)
    if isinstance(hook, NeighborListHook):
        raise InputError(
            "a NeighborListHook does not belong on DomainParallel: the DistributedModel builds "
            "one list per subdomain (with ghosts) and migrates atoms itself; drop the hook"
        )
    # these read global numbers through dynamics.reduce and print on the root only:
    # correct on owned atoms, and nothing needs gathering
    if isinstance(hook, (ThermoLogger, ProgressBar)):
        return HookScope.LOCAL
    return HookScope.RANK_ZERO


def check_hook(hook) -> None:
    if not hasattr(hook, "stage") or not hasattr(hook, "frequency") or not callable(hook):
        raise InputError(
            f"{hook!r} is not a dynamics hook: give it a `stage`, an integer `frequency` and "
            "`__call__(ctx, stage)`"
        )
    hook_stages(hook)
