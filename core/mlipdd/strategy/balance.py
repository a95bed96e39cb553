"""Load balancing of the halo strategy: cut planes that follow the atoms, not the cell.

Uniform cuts leave a rank with vacuum owning few atoms while its neighbour owns most,
and a step takes as long as the slowest rank. `LoadBalance` moves the cut planes of the
`RankGrid` along each grid axis (always planes of the cell's own lattice, i.e. cuts in
fractional coordinates, so triclinic cells stay exact):

* ``"count"``: each slab along an axis holds the same number of atoms;
* ``"time"``: each slab carries the same measured force time. Every atom is weighted by
  its owner's force time per owned atom since the last balance, and the planes move
  only ``damping`` of the way towards the weighted quantiles, so noisy timings do not
  make them oscillate.

Both re-balance at neighbour-list rebuilds, every ``every`` rebuilds (and ``"count"``
also right after `partition`). Ownership changes only there, so the migration and
halo plan of that same rebuild already use the new planes; nothing else changes.

# NOTE [agreed planes]
Every rank must own by the same planes. The planes come from a per-axis histogram of
fractional coordinates (weighted for ``"time"``) summed with one ``all_reduce``; cuts
are placed at its quantiles, linearly inside the bin, and rank 0's result is then
broadcast, so a last-bit difference in a floating-point reduction can never make two
ranks disagree on an owner. The per-rank times travel in one ``all_gather``.

# NOTE [what "time" measures]
The force time is the main thread's CPU time (``time.thread_time``) inside the model
call: a rank blocked in a gloo collective waiting for a slower rank does not burn CPU,
so waiting is not counted as work. That holds for CPU runs; on a GPU the host time is
launch overhead, not kernel time, so ``"time"`` is refused there (use ``"count"``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mlipdd.data import InputError
from mlipdd.strategy.grid import RankGrid

BALANCE_MODES = ("count", "time")
HISTORY_LENGTH = 1000  # rebuild records kept (a long run rebuilds 1e5 times)
HISTOGRAM_BINS = 4096  # per axis; a cut lands within the bin by linear interpolation


def check_balance(mode: str | None, every: int, damping: float) -> None:
    """The DomainConfig checks (raised identically on every rank: pure input checks)."""
    if mode is not None and mode not in BALANCE_MODES:
        raise InputError(f"DomainConfig.balance must be None, 'count' or 'time', got {mode!r}")
    if int(every) < 1:
        raise InputError(f"DomainConfig.balance_every must be >= 1 (rebuilds between balances), got {every}")
    if not 0.0 < float(damping) <= 1.0:
        raise InputError(
            f"DomainConfig.balance_damping must be in (0, 1] (the share of the way the planes move "
            f"per balance; 1 moves them all the way), got {damping}"
        )


@dataclass
class LoadBalance:
    """Per strategy: when and how to move the planes, the measured times, and the log.

    ``imbalance`` is max/mean owned atoms per rank at the latest rebuild (1.0: even);
    ``history`` one record per rebuild, the latest `HISTORY_LENGTH`:
    ``{"rebuild", "imbalance", "owned", "cuts"}``.
    """

    mode: str | None = None
    every: int = 10
    damping: float = 0.5
    group: object = None
    imbalance: float | None = None
    history: list = field(default_factory=list)
    _seconds: float = 0.0
    _calls: int = 0
    _rebuilds_since: int = 0

    @classmethod
    def from_config(cls, config, group=None) -> LoadBalance:
        mode = getattr(config, "balance", None)
        return cls(mode, int(getattr(config, "balance_every", 10)), float(getattr(config, "balance_damping", 0.5)),
                   group)

    # ---- measuring ------------------------------------------------------------------------
    def timing(self):
        """Context around the model call; times it only in ``"time"`` mode."""
        return self._timed() if self.mode == "time" else contextlib.nullcontext()

    @contextlib.contextmanager
    def _timed(self):
        start = time.thread_time()
        try:
            yield
        finally:
            self._seconds += time.thread_time() - start
            self._calls += 1

    # ---- deciding -------------------------------------------------------------------------
    def at_partition(self, grid: RankGrid, frac: torch.Tensor, device) -> RankGrid:
        """Collective: planes for a freshly partitioned system (nothing timed yet: by count)."""
        if self.mode is None:
            return grid
        if self.mode == "time" and device is not None and torch.device(device).type == "cuda":
            raise InputError(
                "balance='time' measures host CPU time, which on a GPU is launch overhead, not the "
                "force time; use DomainConfig(balance='count') on GPUs"
            )
        self._reset()
        return grid.with_cuts(balanced_cuts(frac, None, grid.dims, self.group))

    def at_rebuild(self, grid: RankGrid, frac: torch.Tensor) -> RankGrid:
        """Collective, called at every rebuild before migration: the planes to own by now."""
        if self.mode is None:
            return grid
        self._rebuilds_since += 1
        if self._rebuilds_since < self.every:
            return grid
        weights = self._atom_weights(frac.shape[0]) if self.mode == "time" else None
        target = balanced_cuts(frac, weights, grid.dims, self.group)
        if self.mode == "time" and self.damping < 1.0:
            old = [grid.bounds(a) for a in range(3)]
            target = [o + self.damping * (t - o) for o, t in zip(old, target, strict=True)]
        self._reset()
        return grid.with_cuts(target)

    def record(self, grid: RankGrid, n_owned: int, rebuild: int) -> None:
        """Collective, after migration: owned atoms of every rank -> ``imbalance``."""
        owned = _all_gather_floats([float(n_owned)], self.group)[:, 0]
        mean = float(owned.mean())
        self.imbalance = float(owned.max()) / mean if mean > 0 else 1.0
        cuts = grid.cuts if grid.cuts is not None else tuple(tuple(grid.bounds(a).tolist()) for a in range(3))
        self.history.append(
            {"rebuild": rebuild, "imbalance": self.imbalance, "owned": [int(x) for x in owned], "cuts": cuts}
        )
        del self.history[:-HISTORY_LENGTH]

    def _atom_weights(self, n_owned: int) -> torch.Tensor | None:
        """Each owned atom's share of its rank's force time per call (all_gather'd, so every
        rank falls back to counting together when some rank has no timing)."""
        mine = [self._seconds / max(self._calls, 1), float(self._calls)]
        every = _all_gather_floats(mine, self.group)
        if bool((every[:, 1] == 0).any()) or not bool((every[:, 0] > 0).all()):
            return None
        return torch.full((n_owned,), mine[0] / max(n_owned, 1), dtype=torch.float64)

    def _reset(self) -> None:
        self._seconds, self._calls, self._rebuilds_since = 0.0, 0, 0


def load_balance_of(strategy) -> LoadBalance | None:
    """The `LoadBalance` of a strategy that moves its cut planes (``Strategy.balance``);
    None for any other strategy."""
    return strategy.balance


def balanced_cuts(frac: torch.Tensor, weights: torch.Tensor | None, dims, group=None,
                  bins: int = HISTOGRAM_BINS) -> list[torch.Tensor]:
    """Collective: per axis the ``g + 1`` cuts that split the (weighted) atoms evenly.

    ``frac`` (n, 3) this rank's wrapped fractional coordinates; ``weights`` (n,) or None
    (count). See NOTE [agreed planes].
    """
    frac = frac.detach().to("cpu", torch.float64)
    w = torch.ones(frac.shape[0], dtype=torch.float64) if weights is None else weights.to("cpu", torch.float64)
    bin_of = (frac * bins).floor().long().clamp_(0, bins - 1)
    hist = torch.zeros(3, bins, dtype=torch.float64)
    for a in range(3):
        hist[a].index_add_(0, bin_of[:, a], w)
    hist = _all_reduce(hist, group)
    cuts = torch.zeros(sum(g + 1 for g in dims), dtype=torch.float64)
    start = 0
    for a, g in enumerate(dims):
        cuts[start : start + g + 1] = _quantile_cuts(hist[a], g)
        start += g + 1
    cuts = _broadcast_from_first(cuts, group)
    return list(torch.split(cuts, [g + 1 for g in dims]))


def _quantile_cuts(hist: torch.Tensor, g: int) -> torch.Tensor:
    """Cuts at the ``c / g`` quantiles of a histogram over [0, 1), linear inside a bin."""
    bins = hist.shape[0]
    uniform = torch.arange(g + 1, dtype=torch.float64) / g
    cdf = torch.cumsum(hist, 0)
    total = float(cdf[-1])
    if g == 1 or total <= 0:
        return uniform
    targets = total * uniform[1:-1]
    k = torch.searchsorted(cdf, targets).clamp_(max=bins - 1)  # first bin with cdf >= target
    below = cdf[k] - hist[k]
    inside = torch.where(hist[k] > 0, (targets - below) / hist[k].clamp_min(1e-300), torch.zeros_like(targets))
    inner = ((k.double() + inside.clamp(0, 1)) / bins).clamp(0, 1)
    # A target met exactly at the end of a bin, with empty bins after it (a gap between
    # layers, vacuum): cut in the middle of the gap, not against the last atoms.
    after = torch.searchsorted(cdf, targets, right=True).clamp_(max=bins)  # first bin with cdf > target
    exact = (cdf[k] == targets) & (after > k + 1)
    inner = torch.where(exact, (k.double() + 1 + after.double()) / (2 * bins), inner)
    inner = torch.cummax(inner, 0).values  # non-decreasing whatever the rounding
    return torch.cat([uniform[:1], inner, uniform[-1:]])


def _distributed(group) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if _distributed(group):
        t = t.to(_comm_device(group))
        dist.all_reduce(t, group=group)
    return t.cpu()


def _broadcast_from_first(t: torch.Tensor, group) -> torch.Tensor:
    if _distributed(group):
        t = t.to(_comm_device(group))
        dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return t.cpu()


def _all_gather_floats(values: list[float], group) -> torch.Tensor:
    mine = torch.tensor(values, dtype=torch.float64)
    if not _distributed(group):
        return mine[None]
    device = _comm_device(group)
    out = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine.to(device), group=group)
    return torch.stack(out).cpu()


def _comm_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
