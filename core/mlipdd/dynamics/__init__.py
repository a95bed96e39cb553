"""Molecular dynamics on a `Batch`: integrators, stages, hooks, global reductions.

Everything here is single-process code written so the distributed runtime can drive
it on each rank's owned atoms unchanged: per-atom updates only, global sums through
``dynamics.reduce`` (`GlobalReducer`), and random numbers keyed by atom id.
"""

from mlipdd.dynamics.base import BaseDynamics, DynamicsHook, DynamicsStage, HookContext
from mlipdd.dynamics.fire import FIRE, FIRE2
from mlipdd.dynamics.hooks import NeighborListHook, ProgressBar, ThermoLogger, TrajectoryWriter
from mlipdd.dynamics.integrators import NVE, NVTLangevin
from mlipdd.dynamics.nose_hoover import NoseHoover
from mlipdd.dynamics.npt import NPH, NPT
from mlipdd.dynamics.reduce import GlobalReducer
from mlipdd.dynamics.stop import RunStopped, stop_on_signals
from mlipdd.dynamics.velocities import initialize_velocities

__all__ = [
    "NVE",
    "BaseDynamics",
    "DynamicsHook",
    "DynamicsStage",
    "GlobalReducer",
    "HookContext",
    "NVTLangevin",
    "NeighborListHook",
    "ProgressBar",
    "ThermoLogger",
    "TrajectoryWriter",
    "initialize_velocities",
]

__all__ += ["FIRE", "FIRE2", "NPH", "NPT", "NoseHoover", "RunStopped", "stop_on_signals"]
