"""``mlipdd run --restart``: continue the checkpoint's run, with its model, system and settings.

A checkpoint written by ``mlipdd run`` carries a *run record* (`Checkpoint.run`): the
model's plugin name, its arguments, every argument that names a file (the weights) with
that file's sha256, the system's source and size, and the ensemble. A restart

* takes every setting the user left unset from the checkpoint: the model and its
  arguments, the ensemble, and the integrator's settings (dt, temperature, seed,
  friction, damping times, pressure), so ``mlipdd run --restart s.pt`` continues the very
  same trajectory;
* refuses a different model (another name, other arguments, or a weights file whose
  bytes changed since), in one line naming both, unless the user allows it
  (``--restart-allow-model-change``): a silently swapped model is a wrong number;
* refuses ``--system`` / ``--size`` that differ from the checkpoint's: the system *is*
  the checkpoint's; for a checkpoint without a record (written by the library) they
  cannot be compared and are reported as ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from mlipdd.data import InputError

# settings a restart takes from the checkpoint's integrator when the user left them unset:
# RunConfig field -> integrator attribute (mlipdd.distributed.checkpoint.SETTINGS)
FROM_INTEGRATOR = {
    "dt": "dt_fs",
    "temperature": "temperature_K",
    "seed": "seed",
    "friction": "friction_per_fs",
    "tdamp": "tdamp_fs",
    "pdamp": "pdamp_fs",
    "pressure": "pressure_bar",
}
# the integrator class a checkpoint names -> the --ensemble that builds it
ENSEMBLE_OF_CLASS = {
    "NVE": "nve", "NVTLangevin": "nvt", "NoseHoover": "nh", "NPT": "npt", "NPH": "nph",
    "FIRE": "fire", "FIRE2": "fire2",
}
ALLOW_FLAG = "--restart-allow-model-change"


def sha256_of_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    """JSON-plain data (dicts, lists, str, numbers, None): what a pickle-free checkpoint holds."""
    return json.loads(json.dumps(value, default=str))


def model_identity(model: str, model_args: dict[str, Any]) -> dict[str, Any]:
    """Name, arguments and the sha256 of every argument that names an existing file."""
    files = {}
    for key, value in model_args.items():
        if isinstance(value, str) and value and Path(value).is_file():
            files[key] = {"path": str(Path(value).resolve()), "sha256": sha256_of_file(value)}
    return {"name": model, "args": _plain(model_args), "files": files}


def run_record(cfg) -> dict[str, Any]:
    """What a checkpoint of this run stores about it (`Checkpoint.run`)."""
    return {
        "model": model_identity(cfg.model, dict(cfg.model_args)),
        "system": cfg.system,
        "size": cfg.size,
        "ensemble": cfg.ensemble,
    }


def read_restart(cfg):
    """The checkpoint of ``cfg.restart`` (None without a restart)."""
    if not cfg.restart:
        return None
    from mlipdd.distributed.checkpoint import load_checkpoint

    return load_checkpoint(cfg.restart, device=cfg.resolved_device())


def settings_from_checkpoint(cfg, checkpoint):
    """``cfg`` with what the user left unset taken from ``checkpoint`` (see the module
    docstring); refuses a model or a system other than the checkpoint's."""
    record = checkpoint.run or {}
    shown = repr(str(cfg.restart))
    cfg = _with_model(cfg, record.get("model"), shown)
    cfg = _with_system(cfg, record, shown)
    ensemble = record.get("ensemble") or ENSEMBLE_OF_CLASS.get(checkpoint.dynamics_class)
    saved = checkpoint.dynamics_settings or {
        k: v for k, v in checkpoint.dynamics_state.items() if k in FROM_INTEGRATOR.values()
    }
    unset = {
        name: _number(saved[attr])
        for name, attr in FROM_INTEGRATOR.items()
        if getattr(cfg, name) is None and attr in saved
    }
    if cfg.ensemble is None and ensemble is not None:
        unset["ensemble"] = ensemble
    elif ensemble is not None and cfg.ensemble != ensemble:
        raise InputError(
            f"checkpoint {shown} continues a --ensemble {ensemble} run, this run asks for "
            f"--ensemble {cfg.ensemble}; drop --ensemble (an integrator's state does not carry "
            "over to another one; to switch, start a new run from the last trajectory frame)"
        )
    return dataclasses.replace(cfg, **unset)


def _number(value):
    if hasattr(value, "tolist"):  # a 0-d tensor (temperature targets are kept as tensors)
        value = value.tolist()
    return value


def _with_model(cfg, saved: dict | None, shown: str):
    if not saved:  # a checkpoint without a record: nothing to compare
        if cfg.model is None:
            print(
                f"mlipdd run: note: checkpoint {shown} does not record its model (written by the "
                "library); continuing with the default model lj; give --model and --model-arg of "
                "the run that wrote it otherwise",
                file=sys.stderr,
                flush=True,
            )
        return cfg
    given_model = cfg.model is not None or bool(cfg.model_args)
    if not given_model:  # the checkpoint's; its files where they were (a restart may run elsewhere)
        args = dict(saved.get("args") or {})
        args.update({k: f["path"] for k, f in (saved.get("files") or {}).items() if k in args})
        cfg = dataclasses.replace(cfg, model=saved["name"], model_args=args)
    mine = model_identity(cfg.model or saved["name"], dict(cfg.model_args))
    problem = _model_difference(saved, mine, shown)
    if problem is None:
        return cfg if cfg.model is not None else dataclasses.replace(cfg, model=saved["name"])
    if cfg.restart_allow_model_change:
        print(f"mlipdd run: note: {problem}; continuing anyway ({ALLOW_FLAG})", file=sys.stderr,
              flush=True)
        return cfg if cfg.model is not None else dataclasses.replace(cfg, model=saved["name"])
    raise InputError(
        f"{problem}; restart with the checkpoint's model (leave out --model and --model-arg), "
        f"or pass {ALLOW_FLAG} to continue with another one"
    )


def _describe(identity: dict) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in sorted((identity.get("args") or {}).items()))
    return f"{identity.get('name')}({args})"


def _model_difference(saved: dict, mine: dict, shown: str) -> str | None:
    """What differs: the name, an argument other than a file, a file's bytes (a file may
    have moved, or be named relative to another folder: its sha256 decides)."""
    files = set(saved.get("files") or {})

    def settings(args: dict) -> dict:
        return {k: "<a file>" if k in files else v for k, v in _plain(args).items()}

    if saved.get("name") != mine["name"] or settings(saved.get("args") or {}) != settings(mine["args"]):
        return (f"checkpoint {shown} was written with model {_describe(saved)}, this run asks for "
                f"{_describe(mine)}")
    for key, then in (saved.get("files") or {}).items():
        now = mine["files"].get(key)
        if now is None:
            return (f"checkpoint {shown}'s model file {key}={then.get('path')!r} (sha256 "
                    f"{str(then.get('sha256'))[:12]}...) is missing now")
        if now["sha256"] != then.get("sha256"):
            return (f"the model file {key}={now['path']!r} changed since checkpoint {shown} "
                    f"was written (sha256 {str(then.get('sha256'))[:12]}... then, {now['sha256'][:12]}... "
                    "now)")
    return None


def _with_system(cfg, record: dict, shown: str):
    if "system" not in record:
        if cfg.system is not None or cfg.size is not None:
            print(
                f"mlipdd run: note: --system/--size are ignored with --restart: the run continues "
                f"the system of checkpoint {shown}",
                file=sys.stderr,
                flush=True,
            )
        return dataclasses.replace(cfg, system=f"checkpoint {cfg.restart}", size=None)
    saved_system, saved_size = record.get("system"), record.get("size")
    given = [
        (flag, mine, theirs)
        for flag, mine, theirs in (("--system", cfg.system, saved_system), ("--size", cfg.size, saved_size))
        if mine is not None and mine != theirs
    ]
    if given:
        which = ", ".join(f"{flag} {mine} (the checkpoint's: {theirs})" for flag, mine, theirs in given)
        raise InputError(
            f"{which} conflict with --restart {shown}: a restart continues the checkpoint's system; "
            "drop them (to start another system, leave out --restart)"
        )
    return dataclasses.replace(cfg, system=saved_system, size=saved_size)


# NOTE [trajectory of a restart]: a restart given the trajectory path of the run it
# continues appends to it (`TrajectoryWriter(append=True)`), skipping the steps the file
# holds already, so one file holds the whole run. A file that holds frames *past* the
# checkpoint's step (the run went on after its last checkpoint) would get steps twice
# and out of order: refused, as is a file that does not read as a trajectory.
def check_trajectory_continues(cfg, step: int) -> None:
    if not cfg.trajectory:
        return
    from mlipdd.dynamics.hooks.trajectory import last_frame_step

    last = last_frame_step(cfg.trajectory)
    if last is not None and last > step:
        raise InputError(
            f"trajectory {cfg.trajectory!r} holds frames up to step {last}, past the step of "
            f"checkpoint {str(cfg.restart)!r} ({step}): appending would repeat steps {step + 1}-"
            f"{last}; give another --trajectory path (or cut the file at step {step})"
        )


def restored_or_partitioned(dp, cfg, batch):
    """This run's owned atoms: the checkpoint's system (``--restart``, partitioned over this
    run's ranks, any number) or ``batch`` (the full system on rank 0)."""
    if not cfg.restart:
        return dp.partition(batch)
    with settings_differences_as_notes():
        return dp.restore(cfg.restart)


@contextlib.contextmanager
def settings_differences_as_notes():
    """Around restoring the integrator: a setting the user changed on purpose (``--dt 1``
    on a 2 fs checkpoint) is said in one ``note:`` line each, not as a Python warning
    with a source line; other warnings pass through unchanged."""
    from mlipdd.distributed.checkpoint import CheckpointSettingsWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointSettingsWarning)
        yield
    for w in caught:
        if issubclass(w.category, CheckpointSettingsWarning):
            print(f"mlipdd run: note: {w.message}", file=sys.stderr, flush=True)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
