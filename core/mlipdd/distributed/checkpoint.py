"""Checkpoint and restart: one file holds a whole run, whatever the number of ranks.

What a restart needs to continue the *same* trajectory:

* every per-atom field of the full system in global atom-id order (positions wrapped
  into the cell plus the ``image`` crossing counts, velocities, masses, ids, species and
  any extra node property, e.g. per-atom integrator state that travels with atoms);
* the per-system fields (cell, pbc, charge, ...), energy/forces excepted: they are
  recomputed from the positions at restart;
* the integrator's declared state (``state_dict()``): step count (which also keys the
  Langevin noise: the noise is a pure function of seed, step and atom id, so there is no
  generator state to save), thermostat / barostat variables, the bath-energy ledger;
* the integrator's settings (dt, temperature, seed, ...), recorded only to tell the user
  when the restarted script's differ: the script's win (`restore_dynamics`);
* optionally the ``run`` record of the application that wrote it (``mlipdd run``: the
  model's name, arguments and weights files with their sha256, the system's source and
  the ensemble), so a restart continues with that model and refuses another one
  (`mlipdd.app.restart`). The library itself never reads it.

The file is written by one process (rank 0) to a temporary name in the same folder,
synced, then renamed over the target, so a reader sees the old or the new checkpoint,
never half of one. It holds tensors, numbers and strings only and loads with
``torch.load(weights_only=True)``.

NOTE [checkpoint checksum]: torch's zip reader does not check the archive's CRCs, so a
flipped bit in tensor data would load and run (positions moved, no complaint). Since
format version 2 the file carries ``checksum = {"sha256": ...}``, a digest of everything
else in it (`payload_digest`: keys, types, dtypes, shapes and tensor bytes, in a fixed
order), written by `write_atomically` and verified by `load_checkpoint` before anything
is used. Version-1 files (no checksum) still load, unverified. A file that is not a
torch zip archive at all (random bytes, a trajectory) is "not an mlipdd checkpoint",
one line, before torch is asked to read it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import pickle
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlipdd.data import Batch, InputError
from mlipdd.distributed.hooks import HookScope
from mlipdd.dynamics.base import DynamicsStage

FORMAT = "mlipdd-checkpoint"
VERSION = 2  # 2: with a checksum (NOTE [checkpoint checksum]); 1 still loads
CHECKSUM_KEY = "checksum"

# node/system fields that are outputs or views, recomputed on restart
_DERIVED_NODE = {"forces", "unwrapped_positions", "energies"}
_DERIVED_SYSTEM = {"energy", "stress"}
# integrator settings a checkpoint records, to tell the user when the script's differ
SETTINGS = ("dt_fs", "temperature_K", "friction_per_fs", "seed", "tdamp_fs", "pressure_bar", "pdamp_fs")


class CheckpointSettingsWarning(UserWarning):
    """The integrator's settings differ from the checkpoint's; the integrator's are used."""


@dataclass
class Checkpoint:
    batch: Batch  # the full system, global atom-id order, with ``image`` counts
    dynamics_class: str
    dynamics_state: dict[str, Any]
    world_size: int  # ranks of the run that wrote it (informational)
    dynamics_settings: dict[str, Any] = field(default_factory=dict)  # dt, temperature, ...
    run: dict[str, Any] = field(default_factory=dict)  # the writer's record (model, system)

    @property
    def step(self) -> int:
        return int(self.dynamics_state.get("step_count", 0))


# ---- integrator state ---------------------------------------------------------------------
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
    """The integrator's restartable state: its ``state_dict()`` (see NOTE [declared state]
    in `mlipdd.dynamics.base`). Per-atom state must live on the batch as a node property:
    an attribute holds only this rank's atoms under domain decomposition."""
    return _to_cpu(dict(_integrator(dynamics).state_dict()))


def dynamics_settings(dynamics) -> dict[str, Any]:
    dyn = _integrator(dynamics)
    return _to_cpu({name: getattr(dyn, name) for name in SETTINGS if hasattr(dyn, name)})


def restore_dynamics(dynamics, checkpoint: Checkpoint, device=None) -> None:
    """Put the checkpoint's integrator state into ``dynamics`` (same integrator class).

    Only the integrator's declared state comes back (step count, thermostat and barostat
    variables, the bath-energy ledger), never its wiring or checks. **Settings are the
    script's**: dt, temperature, friction, seed, damping times and pressure stay what the
    integrator was built with, as in LAMMPS, where the input script's ``timestep`` and
    fixes apply after ``read_restart``. When they differ from the checkpoint's, a
    `CheckpointSettingsWarning` names each one (build the integrator with the checkpoint's
    values to continue the very same trajectory).
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
    dyn.load_state_dict(state)
    dyn.target_step = dyn.step_count
    if getattr(dyn.reduce, "is_root", True):
        _warn_about_settings(dyn, checkpoint)


def _warn_about_settings(dyn, checkpoint: Checkpoint) -> None:
    # checkpoints written before settings were kept apart hold them among the state
    saved = checkpoint.dynamics_settings or {
        k: v for k, v in checkpoint.dynamics_state.items() if k in SETTINGS
    }
    for name, value in saved.items():
        if not hasattr(dyn, name):
            continue
        current = getattr(dyn, name)
        if _same(current, value):
            continue
        warnings.warn(
            f"the checkpoint was written with {name} = {_show(value)} but this integrator has "
            f"{_show(current)}: the integrator's value is used. To continue the very same "
            f"trajectory, build the integrator with {name} = {_show(value)}",
            CheckpointSettingsWarning,
            stacklevel=3,
        )


def _same(a, b) -> bool:
    try:
        ta, tb = torch.as_tensor(a).cpu().double(), torch.as_tensor(b).cpu().double()
        return ta.shape == tb.shape and bool(torch.allclose(ta, tb, rtol=1e-12, atol=0))
    except (TypeError, ValueError, RuntimeError):
        return a == b


def _show(value) -> str:
    if torch.is_tensor(value):
        value = value.tolist()
    return f"{value:g}" if isinstance(value, float) else str(value)


# ---- the file -----------------------------------------------------------------------------
def checkpoint_payload(
    full: Batch, dynamics, world_size: int = 1, run: dict[str, Any] | None = None
) -> dict[str, Any]:
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
        "dynamics_settings": dynamics_settings(dynamics),
        "run": dict(run or {}),
    }


# ---- checksum (NOTE [checkpoint checksum]) --------------------------------------------------
def _feed(digest, value) -> None:
    """Feed ``value`` to ``digest`` unambiguously: a type tag, then a length-prefixed body."""

    def chunk(tag: bytes, body: bytes | memoryview) -> None:
        digest.update(tag + len(body).to_bytes(8, "little"))
        digest.update(body)

    if torch.is_tensor(value):
        flat = value.detach().cpu().contiguous().reshape(-1)
        chunk(b"T", f"{flat.dtype}{tuple(value.shape)}".encode())
        chunk(b"B", memoryview(flat.view(torch.uint8).numpy()))
    elif isinstance(value, dict):
        chunk(b"D", str(len(value)).encode())
        for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
            _feed(digest, key)
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        chunk(b"L", str(len(value)).encode())
        for item in value:
            _feed(digest, item)
    else:  # None, bool, int, float (repr is exact), str, torch.dtype, ...
        chunk(b"S", f"{type(value).__qualname__}:{value!r}".encode())


def payload_digest(payload: dict) -> str:
    """The sha256 (hex) of a checkpoint payload, its ``checksum`` entry excepted."""
    digest = hashlib.sha256()
    _feed(digest, {k: v for k, v in payload.items() if k != CHECKSUM_KEY})
    return digest.hexdigest()


def write_atomically(payload: dict, path: str | Path) -> Path:
    """torch.save to a temporary file beside ``path``, fsync, then rename over ``path``.

    The file gets the payload's checksum (NOTE [checkpoint checksum]), computed here, so
    whatever a caller put in the payload is covered.

    A write killed outright (SIGKILL, power loss) leaves its temporary file behind; the
    next successful write of the same checkpoint removes such leftovers
    (`remove_leftover_temporaries`). The file gets the permissions of any new file
    (``mkstemp`` alone would make it private to its owner).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        payload = {**payload, CHECKSUM_KEY: {"sha256": payload_digest(payload)}}
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    remove_leftover_temporaries(path)
    return path


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask would, for a moment, process-wide)
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove_leftover_temporaries(path: str | Path) -> list[Path]:
    """Delete the temporary files of earlier, interrupted writes of checkpoint ``path``.

    Only one process writes a given checkpoint (rank 0), so once it has finished a write,
    any other ``.NAME.*.tmp`` beside it belongs to a write that will never finish.
    """
    path = Path(path)
    removed = []
    for leftover in path.parent.glob(f"{_temporary_prefix(path)}*.tmp"):
        with contextlib.suppress(OSError):
            leftover.unlink()
            removed.append(leftover)
    return removed


# ---- one writer per checkpoint path -------------------------------------------------------------
# NOTE [checkpoint lock]: two runs given the same checkpoint path would overwrite each
# other's state, and each write's clean-up (`remove_leftover_temporaries`) deletes the
# other run's temporary file mid-write. So a writer holds an exclusive ``flock`` on
# ``.NAME.lock`` beside the checkpoint for as long as its process runs (the kernel drops
# it when the process ends, however it ends); a second run is refused in one line naming
# the holder's pid, which the lock file holds. Held once per process (a run that writes the
# same path twice in one process, as tests do, shares it).
_held_locks: dict[Path, int] = {}


def _lock_path(path: Path) -> Path:
    return path.parent / f".{path.name}.lock"


def hold_checkpoint_path(path: str | Path) -> Path:
    """Take the lock of checkpoint ``path`` for this process (NOTE [checkpoint lock]);
    an `InputError` naming the other run's pid when it is held elsewhere. Idempotent."""
    import fcntl

    path = Path(path).resolve()
    if path in _held_locks:
        return path
    lock = _lock_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise InputError(
                f"checkpoint {str(path)!r} is being written by another run (pid {holder}; lock "
                f"{lock.name}); give this run another --checkpoint path, or wait for that one to end"
            ) from None
        # the holder before us may have removed the file after we opened it: lock the live one
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode("ascii"))
    _held_locks[path] = fd
    atexit.register(release_checkpoint_path, path)  # the file too (the kernel drops the lock)
    return path


def release_checkpoint_path(path: str | Path) -> None:
    """Give the lock of ``path`` back (removing its file first, while still held)."""
    path = Path(path).resolve()
    fd = _held_locks.pop(path, None)
    if fd is None:
        return
    with contextlib.suppress(OSError):
        _lock_path(path).unlink()
    os.close(fd)


def save_checkpoint(
    path: str | Path, full: Batch, dynamics, world_size: int = 1, run: dict[str, Any] | None = None
) -> Path:
    """Write the full system ``full`` (id order) and ``dynamics``' state; single process.

    Under domain decomposition use `DomainParallel.save_checkpoint` (collective) or a
    `CheckpointWriter` hook, which gather the system to rank 0 first.
    """
    return write_atomically(checkpoint_payload(full, dynamics, world_size, run), path)


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive
_REQUIRED = {
    "node": dict, "system": dict, "dynamics_class": str, "dynamics_state": dict, "world_size": int,
}
_WRITTEN_BY = "pass a file written by mlipdd (--checkpoint, save_checkpoint or a CheckpointWriter)"


def _what_it_is(head: bytes) -> str:
    if head.startswith(b"- of Ulm"):
        return "an ASE trajectory"
    if not head:
        return "an empty file"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return "not a torch.save archive"
    return "a text file"


def _one_line(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read(path: Path):
    shown = repr(str(path))
    try:
        with open(path, "rb") as handle:
            head = handle.read(64)
    except OSError as exc:
        raise InputError(
            f"checkpoint {shown} cannot be read ({exc.strerror or exc}); check the path and permissions"
        ) from None
    if not head.startswith(_ZIP_MAGIC):
        raise InputError(
            f"{shown} is not an mlipdd checkpoint ({_what_it_is(head)}), so it cannot be read; "
            f"{_WRITTEN_BY}"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower():  # Python objects beyond tensors and plain data
            raise InputError(
                f"{shown} is not an mlipdd checkpoint (it holds Python objects, not only tensors, "
                "numbers and strings; it was not unpickled, nothing in it ran), so it cannot be read; "
                f"{_WRITTEN_BY}"
            ) from None
        raise _damaged(path, f"torch could not read it: {_one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - a damaged archive: reported with the file name
        why = f"torch could not read it: {type(exc).__name__}: {_one_line(exc)}"
        raise _damaged(path, why) from None


def _damaged(path: Path, why: str) -> InputError:
    return InputError(
        f"checkpoint {str(path)!r} is damaged ({why}); restart from an older checkpoint or a copy "
        "of this one"
    )


def _verify(path: Path, data: dict) -> None:
    """Check the version and the checksum (NOTE [checkpoint checksum]) before anything is used."""
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise _damaged(path, f"its format version is {version!r}")
    if version > VERSION:
        raise InputError(
            f"checkpoint {str(path)!r} has format version {version}, newer than this mlipdd reads "
            f"({VERSION}); upgrade mlipdd"
        )
    stored = data.get(CHECKSUM_KEY)
    if stored is None:
        if version >= 2:
            raise _damaged(path, "it lacks the checksum every version-2 checkpoint carries")
        return  # version 1: written before checksums, loads unverified
    expected = stored.get("sha256") if isinstance(stored, dict) else None
    if not isinstance(expected, str):
        raise _damaged(path, f"its checksum entry is {stored!r}")
    found = payload_digest(data)
    if found != expected:
        raise _damaged(
            path,
            f"its contents do not match the sha256 written with it ({expected[:12]}... written, "
            f"{found[:12]}... now): bytes changed on disk or in transfer",
        )


def load_checkpoint(path: str | Path, device=None) -> Checkpoint:
    """Read a checkpoint written by `save_checkpoint` / `write_atomically`.

    Pickle-free (``weights_only=True``); the checksum is verified before anything is used
    (NOTE [checkpoint checksum]). Every refusal is one `InputError` line naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"checkpoint {str(path)!r} does not exist; check the path")
    data = _read(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(
            f"{str(path)!r} is not an mlipdd checkpoint (no {FORMAT!r} format tag); {_WRITTEN_BY}"
        )
    _verify(path, data)
    for key, kind in _REQUIRED.items():
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            found = "missing" if key not in data else f"a {type(value).__name__}"
            raise _damaged(path, f"its field {key!r} is {found}, not a {kind.__name__}")
    batch = Batch._from_dicts(data["node"], data["system"])
    if device is not None:
        batch = batch.to(device)
    return Checkpoint(
        batch,
        data["dynamics_class"],
        data["dynamics_state"],
        int(data["world_size"]),
        data.get("dynamics_settings") or {},
        _run_record(path, data.get("run")),
    )


def _run_record(path: Path, record) -> dict[str, Any]:
    if record is None:  # written without one (the library, or before records existed)
        return {}
    if not isinstance(record, dict):
        raise _damaged(path, f"its field 'run' is a {type(record).__name__}, not a dict")
    return record


class CheckpointWriter:
    """Hook: save a checkpoint every ``frequency`` steps (and at the end of a run).

    Under `DomainParallel` it runs in the RANK_ZERO scope (the full system gathered to
    rank 0, which alone writes). On a plain integrator it saves the batch it is given.
    """

    stage = (DynamicsStage.AFTER_STEP, DynamicsStage.AFTER_RUN)
    scope = HookScope.RANK_ZERO

    def __init__(self, path: str | Path, frequency: int = 100, run: dict[str, Any] | None = None):
        self.path = Path(path)
        self.frequency = int(frequency)
        self.run = dict(run or {})  # stored with every checkpoint (`Checkpoint.run`)
        self.saved_steps: list[int] = []

    def __call__(self, ctx, stage) -> None:
        if not ctx.dynamics.reduce.is_root:
            return
        if self.saved_steps and self.saved_steps[-1] == ctx.step:
            return
        world_size = getattr(_integrator(ctx.dynamics).reduce, "world_size", 1)
        hold_checkpoint_path(self.path)  # NOTE [checkpoint lock]; a no-op once held
        save_checkpoint(self.path, ctx.batch, ctx.dynamics, world_size, self.run)
        self.saved_steps.append(ctx.step)
