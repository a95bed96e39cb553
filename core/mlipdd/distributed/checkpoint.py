"""Checkpoint and restart: one file holds a whole run, whatever the number of ranks.

What a restart needs to continue the *same* trajectory:

* every per-atom field of the full system in global atom-id order (positions wrapped
  into the cell plus the ``image`` crossing counts, velocities, masses, ids, species and
  any extra node property, e.g. per-atom integrator state that travels with atoms);
* the per-system fields (cell, pbc, charge, ...), energy/forces excepted: they are
  recomputed from the positions at restart;
* the integrator's state: step count (which also keys the Langevin noise: the noise is
  a pure function of seed, step and atom id, so there is no generator state to save),
  seed, thermostat / barostat variables, the bath-energy ledger.

The file is written by one process (rank 0) to a temporary name in the same folder,
synced, then renamed over the target, so a reader sees the old or the new checkpoint,
never half of one. It holds tensors, numbers and strings only and loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlipdd.data import Batch, InputError
from mlipdd.distributed.hooks import HookScope
from mlipdd.dynamics.base import DynamicsStage

FORMAT = "mlipdd-checkpoint"
VERSION = 1

# node/system fields that are outputs or views, recomputed on restart
_DERIVED_NODE = {"forces", "unwrapped_positions", "energies"}
_DERIVED_SYSTEM = {"energy", "stress"}
# integrator attributes that are wiring, not state
_NOT_STATE = {"model", "hooks", "batch", "outputs", "reduce", "target_step"}


@dataclass
class Checkpoint:
    batch: Batch  # the full system, global atom-id order, with ``image`` counts
    dynamics_class: str
    dynamics_state: dict[str, Any]
    world_size: int  # ranks of the run that wrote it (informational)

    @property
    def step(self) -> int:
        return int(self.dynamics_state.get("step_count", 0))


# ---- integrator state ---------------------------------------------------------------------
def _plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if torch.is_tensor(value):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _to_cpu(value):
    if torch.is_tensor(value):
        return value.detach().cpu().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _to_device(value, device):
    """Tensors anywhere in a (nested) state moved to ``device``; integrators keep nested
    state (a thermostat chain's dict inside the integrator's)."""
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _integrator(dynamics):
    """The real integrator behind a gathered hook's view (see `mlipdd.distributed.hooks`)."""
    return getattr(dynamics, "wrapped_dynamics", dynamics)


def dynamics_state(dynamics) -> dict[str, Any]:
    """The integrator's restartable state.

    An integrator with ``state_dict()`` decides itself; otherwise every attribute holding
    numbers, strings or tensors (step count, seed, thermostat variables, bath energy) is
    kept. Per-atom state must live on the batch as a node property: an attribute holds
    only this rank's atoms under domain decomposition.
    """
    dyn = _integrator(dynamics)
    custom = getattr(dyn, "state_dict", None)
    if callable(custom):
        state = dict(custom())
    else:
        state = {k: v for k, v in vars(dyn).items() if k not in _NOT_STATE and _plain(v)}
    return _to_cpu(state)


def restore_dynamics(dynamics, checkpoint: Checkpoint, device=None) -> None:
    """Put the checkpoint's integrator state into ``dynamics`` (same integrator class).

    Settings kept as attributes (dt, temperature, seed, friction) come back too, so the
    trajectory continues exactly; change them after restoring if that is the intent.
    """
    dyn = _integrator(dynamics)
    name = type(dyn).__name__
    if name != checkpoint.dynamics_class:
        raise InputError(
            f"the checkpoint was written by {checkpoint.dynamics_class} but is being restored "
            f"into {name}; build the same integrator, or start the new one from "
            "checkpoint.batch without restoring the integrator state"
        )
    state = checkpoint.dynamics_state
    if device is not None:
        state = _to_device(state, device)
    custom = getattr(dyn, "load_state_dict", None)
    if callable(custom):
        custom(state)
    else:
        for key, value in state.items():
            setattr(dyn, key, value)
    dyn.target_step = dyn.step_count


# ---- the file -----------------------------------------------------------------------------
def checkpoint_payload(full: Batch, dynamics, world_size: int = 1) -> dict[str, Any]:
    node = {k: v for k, v in full.node.items() if k not in _DERIVED_NODE and torch.is_tensor(v)}
    if "image" not in node:  # a single-process run never wraps: zero crossings
        node["image"] = torch.zeros_like(full.positions, dtype=torch.long)
    system = {k: v for k, v in full.system.items() if k not in _DERIVED_SYSTEM and torch.is_tensor(v)}
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": int(world_size),
        "node": _to_cpu(node),
        "system": _to_cpu(system),
        "dynamics_class": type(_integrator(dynamics)).__name__,
        "dynamics_state": dynamics_state(dynamics),
    }


def write_atomically(payload: dict, path: str | Path) -> Path:
    """torch.save to a temporary file beside ``path``, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def save_checkpoint(path: str | Path, full: Batch, dynamics, world_size: int = 1) -> Path:
    """Write the full system ``full`` (id order) and ``dynamics``' state; single process.

    Under domain decomposition use `DomainParallel.save_checkpoint` (collective) or a
    `CheckpointWriter` hook, which gather the system to rank 0 first.
    """
    return write_atomically(checkpoint_payload(full, dynamics, world_size), path)


def load_checkpoint(path: str | Path, device=None) -> Checkpoint:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"checkpoint {str(path)!r} does not exist; check the path")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - reported with the file name and the fix
        raise InputError(
            f"checkpoint {str(path)!r} cannot be read ({type(exc).__name__}: {exc}); it is not an "
            "mlipdd checkpoint or it is damaged: use an older checkpoint"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(f"{str(path)!r} is not an mlipdd checkpoint")
    if int(data.get("version", 0)) > VERSION:
        raise InputError(
            f"checkpoint {str(path)!r} has format version {data['version']}, newer than this "
            f"mlipdd reads ({VERSION}); upgrade mlipdd"
        )
    batch = Batch._from_dicts(data["node"], data["system"])
    if device is not None:
        batch = batch.to(device)
    return Checkpoint(batch, data["dynamics_class"], data["dynamics_state"], int(data["world_size"]))


class CheckpointWriter:
    """Hook: save a checkpoint every ``frequency`` steps (and at the end of a run).

    Under `DomainParallel` it runs in the RANK_ZERO scope (the full system gathered to
    rank 0, which alone writes). On a plain integrator it saves the batch it is given.
    """

    stage = (DynamicsStage.AFTER_STEP, DynamicsStage.AFTER_RUN)
    scope = HookScope.RANK_ZERO

    def __init__(self, path: str | Path, frequency: int = 100):
        self.path = Path(path)
        self.frequency = int(frequency)
        self.saved_steps: list[int] = []

    def __call__(self, ctx, stage) -> None:
        if not ctx.dynamics.reduce.is_root:
            return
        if self.saved_steps and self.saved_steps[-1] == ctx.step:
            return
        world_size = getattr(_integrator(ctx.dynamics).reduce, "world_size", 1)
        save_checkpoint(self.path, ctx.batch, ctx.dynamics, world_size)
        self.saved_steps.append(ctx.step)
