"""Configuration of a domain-decomposed run."""

from __future__ import annotations

from dataclasses import dataclass

from mlipdd.data import InputError
from mlipdd.strategy.kinds import StrategyKind

__all__ = ["DomainConfig", "StrategyKind"]


@dataclass
class DomainConfig:
    """``cutoff``: the model's interaction cutoff; ``skin``: Verlet skin (the halo is
    ``cutoff + skin`` wide and is rebuilt when an atom has moved ``skin / 2``);
    ``grid``: rank grid ``(gx, gy, gz)`` or None to choose the one with least halo."""

    cutoff: float
    skin: float = 0.5
    strategy: StrategyKind = StrategyKind.HALO
    grid: tuple[int, int, int] | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        self.strategy = StrategyKind(self.strategy)
        if not self.cutoff > 0:
            raise InputError(f"DomainConfig.cutoff must be positive, got {self.cutoff}; use the model's cutoff")
        if self.skin < 0:
            raise InputError(f"DomainConfig.skin must be >= 0, got {self.skin}")
        if self.grid is not None and (len(self.grid) != 3 or min(self.grid) < 1):
            raise InputError(f"DomainConfig.grid must be three positive integers, got {self.grid}")

    @property
    def halo_width(self) -> float:
        return self.cutoff + self.skin
