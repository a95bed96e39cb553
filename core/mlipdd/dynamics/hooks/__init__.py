"""Hooks shipped with the dynamics: neighbour list, thermo log, trajectory, progress."""

from mlipdd.dynamics.hooks.neighbor_list import NeighborListHook
from mlipdd.dynamics.hooks.progress import ProgressBar
from mlipdd.dynamics.hooks.thermo import ThermoLogger
from mlipdd.dynamics.hooks.trajectory import TrajectoryWriter

__all__ = ["NeighborListHook", "ProgressBar", "ThermoLogger", "TrajectoryWriter"]
