"""Configuration of a domain-decomposed run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mlipdd.data import InputError
from mlipdd.strategy.balance import check_balance
from mlipdd.strategy.fitting import strategy_name
from mlipdd.strategy.kinds import StrategyKind

__all__ = ["DomainConfig", "StrategyKind"]


@dataclass
class DomainConfig:
    """``cutoff``: the model's interaction cutoff; ``skin``: Verlet skin (the halo is
    ``cutoff + skin`` wide and is rebuilt when an atom has moved ``skin / 2``);
    ``grid``: rank grid ``(gx, gy, gz)`` or None to choose the one with least halo;
    ``strategy``: the name of a registered strategy (``"halo"``, ``"sharded"``,
    ``"graph_partition"``, a plugin's: ``mlipdd_register_strategies``; a `StrategyKind`
    member is its name), kept as that name; None (the default): the model's
    ``preferred_strategy`` when it runs on several ranks under its own spec, halo
    otherwise (`resolve_strategy`; MACE prefers sharded storage);
    ``check_every``: the per-call checks (finite positions in, finite energy / forces /
    stress out) run, and are agreed on by all ranks, on the first call and every
    ``check_every`` calls (each costs a host synchronisation; a NaN in MD persists, so
    it is reported at most ``check_every - 1`` calls late; 1: every call). Neighbour
    list rebuilds always validate the input in full;
    ``balance``: None (uniform cut planes), ``"count"`` (planes moved so every slab holds
    as many atoms) or ``"time"`` (planes moved by measured force time, ``balance_damping``
    of the way), re-balanced every ``balance_every`` neighbour-list rebuilds; it moves the
    planes of a strategy built on spatial ownership (`mlipdd.strategy.balance`);
    ``cuda_graph``: at ONE rank on a CUDA device, capture the model's whole force call
    (forward and force backward) once in a CUDA graph and replay it every call, which
    removes the per-kernel launch cost that dominates small systems (about 900 launches
    for a medium MACE). Each call copies the edges within ``cutoff`` into the graph's
    edge buffers (10% headroom), padded with zero-weight "null" edges; it is captured
    again only when the atom count, the stress flag or the atomic numbers change or the
    edges outgrow the buffers (`mlipdd.distributed.cuda_graph`). The model must give
    zero weight to an edge longer than its cutoff (every model here does; a list built
    with a skin needs it anyway) and must not read the device on the host inside its
    forward. Refused with more than one rank, on CPU tensors, and with a strategy other
    than ``"halo"``;
    ``compile``: run the model's whole force call (forward and force backward) through
    ``torch.compile`` with ``compile_backend`` (``"inductor"``; ``"aot_eager"`` traces the
    same graph without generating code). Every call is padded to per-rank caps of atoms
    and edges (``compile_headroom`` times the first call's sizes; padding atoms sit in a
    padding system of their own, padding edges are null edges), so neighbour-list
    rebuilds and migration do not recompile; a rank that outgrows its caps gets larger
    ones (one recompile, counted in ``DistributedModel.compile_stats``). The first call
    at each new set of shapes, and after integer inputs change, is checked against the
    eager call (`mlipdd.distributed.compiled`). At one rank any model; at several ranks
    under halo and sharded storage, models whose energy is a sum of per-atom energies
    (``atomic_energies``: LJ, MACE through its compile hook, `ToyMPNN`) and wrappers whose own
    forward sums per system only through `mlipdd.distributed.compiled_sums.system_sum`
    (``system_sums_over_ranks``: AIMNet2 with DSF or no Coulomb), each rank's plain rows
    compiled with a ghost shell as deep as the hops the energies read (``message_passing_layers
    * cutoff`` or ``receptive_hop_lengths``, + skin), so that no exchange is needed between
    layers (`mlipdd.distributed.compiled_halo`, NOTE [deep ghost shell]); under graph
    partition the partition helpers' collectives are traced into the graph
    (`mlipdd.distributed.compiled_partition`: UMA). Other wrappers with only their own
    forward are refused at several ranks by name. Refused with ``cuda_graph=True`` (one or
    the other) and with a strategy other than halo, sharded and graph partition."""

    cutoff: float
    skin: float = 0.5
    strategy: str | None = None
    grid: tuple[int, int, int] | None = None
    check_every: int = 10
    balance: str | None = None
    balance_every: int = 10
    balance_damping: float = 0.5
    cuda_graph: bool = False
    compile: bool = False
    compile_backend: str = "inductor"
    compile_headroom: float = 1.2

    def __post_init__(self) -> None:
        self.strategy = None if self.strategy is None else _strategy_name(self.strategy)
        if not self.cutoff > 0:
            raise InputError(f"DomainConfig.cutoff must be positive, got {self.cutoff}; use the model's cutoff")
        if self.skin < 0:
            raise InputError(f"DomainConfig.skin must be >= 0, got {self.skin}")
        if int(self.check_every) < 1:
            raise InputError(f"DomainConfig.check_every must be a positive number of calls, got {self.check_every}")
        if self.grid is not None and (len(self.grid) != 3 or min(self.grid) < 1):
            raise InputError(f"DomainConfig.grid must be three positive integers, got {self.grid}")
        check_balance(self.balance, self.balance_every, self.balance_damping)
        if self.cuda_graph and self.strategy not in (None, "halo"):
            raise InputError(
                f"DomainConfig(cuda_graph=True) replays the one-rank halo path, not the "
                f"{self.strategy_name} strategy; use strategy='halo' (at one rank every strategy "
                "computes the same forces) or leave cuda_graph=False"
            )
        if self.compile:
            _check_compile(self)
        if self.balance is not None and self.strategy is not None and not _strategy_class(self.strategy).spatial:
            raise InputError(
                f"DomainConfig.balance moves the spatial cut planes of a strategy that owns atoms by them "
                f"(halo, sharded); {self.strategy} does not: use strategy='halo' or leave balance=None"
            )

    @property
    def halo_width(self) -> float:
        return self.cutoff + self.skin

    @property
    def strategy_name(self) -> str:
        """The strategy's name; ``"auto"`` while it is still the model's to choose."""
        return "auto" if self.strategy is None else self.strategy


def _check_compile(config: DomainConfig) -> None:
    if config.cuda_graph:
        raise InputError(
            "DomainConfig(compile=True, cuda_graph=True): choose one; cuda_graph replays the eager "
            "force call from a CUDA graph (small systems, host-bound), compile fuses its kernels"
        )
    if config.strategy not in (None, "halo", "sharded", "graph_partition"):
        raise InputError(
            f"DomainConfig(compile=True) compiles the halo, sharded and graph-partition paths, not the "
            f"{config.strategy_name} strategy (torch.compile cannot trace its ShardTensor rows); use "
            "strategy='halo' (at one rank any model, at several a model with atomic_energies: LJ, MACE), "
            "'sharded' (the same models) or 'graph_partition' (a model that builds its own graph), or "
            "leave compile=False"
        )
    if not config.compile_headroom >= 1.0:
        raise InputError(f"DomainConfig.compile_headroom must be >= 1 (caps / sizes), got {config.compile_headroom}")
    if not isinstance(config.compile_backend, str) or not config.compile_backend:
        raise InputError(f"DomainConfig.compile_backend must name a torch.compile backend, got {config.compile_backend!r}")


def resolve_strategy(config: DomainConfig, model, world_size: int, own_spec: bool) -> DomainConfig:
    """``config`` with its strategy decided: as given, or for ``strategy=None`` the model's
    ``preferred_strategy`` when it runs on several ranks under its own spec (an explicit
    spec was written for halo storage unless it says otherwise), else halo. One rank
    stays halo: its one-rank path hands the model plain tensors and costs nothing."""
    if config.strategy is not None:
        return config
    preferred = getattr(model, "preferred_strategy", "halo")
    chosen = preferred if world_size > 1 and own_spec and not (config.cuda_graph or config.compile) else "halo"
    return dataclasses.replace(config, strategy=chosen)


def _strategy_class(name: str) -> type:
    from mlipdd.plugins import get_strategy  # the registry sits above the layers it fills

    return get_strategy(name)


def _strategy_name(value) -> str:
    """The registered name of the strategy ``value`` names (a `StrategyKind` is its name)."""
    from mlipdd.plugins import registry

    name = strategy_name(value)
    known = registry().strategies
    if not isinstance(value, str) or name not in known:
        raise InputError(
            f"DomainConfig.strategy {value!r} is not a registered strategy; use one of "
            f"{sorted(known)} (`mlipdd plugins` lists them), or install / register the plugin "
            "that provides it (hook mlipdd_register_strategies)"
        )
    return name
