"""Write frames (positions, velocities, forces, energy) with ase.io, one flush per frame."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import torch

from mlipdd.data import InputError
from mlipdd.dynamics.base import DynamicsStage


def unwrapped_positions(batch) -> torch.Tensor:
    """Positions with periodic crossings undone (``image`` counts, when present, times the cell)."""
    image = batch.node.get("image")
    if image is None:
        return batch.positions
    cell = batch.cell.detach()[batch.batch]
    return batch.positions + torch.einsum("ni,nij->nj", image.to(batch.dtype), cell)


class TrajectoryWriter:
    """Append a frame every ``frequency`` steps (and the starting frame) to ``path``.

    The format follows the suffix: ``.traj`` (ASE trajectory) or anything ase.io
    writes, extxyz by default. The file is flushed after every frame, so a crash loses
    nothing already written. A batch of several systems writes one frame per system
    per step, tagged with ``atoms.info["system"]``; ``info`` also holds ``step`` and
    ``time_fs``. Positions are unwrapped (NOTE [unwrapped frames]). The file is opened at
    the first frame and closed at the end of the run; a later run of the same writer
    appends. A new writer truncates an old file, unless ``append=True`` (a restart): then
    it continues the file, skipping steps the file already holds.

    NOTE [whole frames]: a frame is written whole or not at all. When the file system
    refuses a write (a full disk, a quota, a file-size limit), the file is cut back to
    its length before the frame (a frame that was the first is removed with the file),
    so it reads as the frames before, and the run stops with one line naming the file.

    Only the root rank writes. Under domain decomposition register this writer where
    it sees the gathered system (the distributed runtime's rank-zero scope).
    """

    stage = (DynamicsStage.BEFORE_RUN, DynamicsStage.AFTER_STEP, DynamicsStage.AFTER_RUN)

    def __init__(
        self, path: str | Path, frequency: int = 10, format: str | None = None, append: bool = False
    ):
        self.path = Path(path)
        self.frequency = int(frequency)
        self.format = format or _format_for(self.path)
        self.append = bool(append)
        self.frames_written = 0
        self._handle = None
        self._last_step: int | None = None
        self._file_holds_through: int | None = None  # append: the file's last step at open

    def __call__(self, ctx, stage) -> None:
        if not ctx.dynamics.reduce.is_root:
            return
        if stage is DynamicsStage.AFTER_RUN:
            self.close()
            return
        if self._handle is None and self.frames_written == 0 and self.append:
            self._file_holds_through = last_frame_step(self.path, self.format)
        if ctx.step == self._last_step:
            return  # written already at this step (AFTER_STEP of a run, BEFORE_RUN of the next)
        if self._file_holds_through is not None and ctx.step <= self._file_holds_through:
            return  # the run a restart continues wrote it
        self._last_step = ctx.step
        batch = ctx.batch
        # NOTE [unwrapped frames]: ranks wrap atoms into the cell when they migrate (the
        # crossings are counted in ``image``, which a checkpoint keeps, also for a restart
        # on one process); one process never wraps. Frames hold the unwrapped positions,
        # so a file is the same at any rank count and MSD works.
        unwrapped = unwrapped_positions(batch).detach().cpu().numpy()
        for s, atoms in enumerate(batch.to_ase()):
            _move_keeping_results(atoms, unwrapped[(batch.batch == s).cpu().numpy()])
            atoms.info.update(step=ctx.step, time_fs=ctx.time_fs, system=s)
            self._write(atoms)

    def _write(self, atoms) -> None:
        existed = self.path.exists()
        size = self.path.stat().st_size if existed else 0
        try:
            self._write_frame(atoms)
        except OSError as exc:
            self._cut_back(size, existed)
            raise InputError(
                f"could not write a frame (step {atoms.info.get('step')}) to trajectory "
                f"{str(self.path)!r}: {exc.strerror or exc}; the file keeps its "
                f"{self.frames_written} whole frame(s) from this run; free space or write "
                "elsewhere, then run again (--restart continues from a --checkpoint)"
            ) from None
        self.frames_written += 1

    def _write_frame(self, atoms) -> None:
        mode = "a" if (self.frames_written or self.append) and self.path.exists() else "w"
        if self.format == "traj":
            from ase.io.trajectory import Trajectory

            if self._handle is None:
                self._handle = Trajectory(str(self.path), mode)
            self._handle.write(atoms)
            # ASE syncs the frame index itself; pushing the bytes to the OS is ours
            fd = getattr(self._handle.backend, "fd", None)
            if fd is not None:
                fd.flush()
            return
        import ase.io

        if self._handle is None:
            self._handle = open(self.path, mode, encoding="utf-8")  # noqa: SIM115
        text = io.StringIO()  # the whole frame first, then one write
        ase.io.write(text, atoms, format=self.format)
        self._handle.write(text.getvalue())
        self._handle.flush()

    def _cut_back(self, size: int, existed: bool) -> None:
        """After a refused write: drop the handle (its buffer may hold part of the frame)
        and cut the file back to ``size`` bytes (NOTE [whole frames])."""
        handle, self._handle = self._handle, None
        raw = getattr(getattr(handle, "backend", None), "fd", handle)
        with contextlib.suppress(OSError, ValueError):
            raw.close()  # may flush more of the frame: cut below
        with contextlib.suppress(OSError):
            if existed and size > 0:
                os.truncate(self.path, size)
            else:
                self.path.unlink()

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            handle.close()


def _move_keeping_results(atoms, positions) -> None:
    """Set ``positions`` and keep the energy and forces attached: ASE drops a single-point
    calculator's results once the atoms differ from those it was made with (the .traj
    writer asks it), so it is made again for the moved atoms."""
    from ase.calculators.singlepoint import SinglePointCalculator

    results = dict(atoms.calc.results) if atoms.calc is not None else {}
    atoms.positions = positions
    if results:
        atoms.calc = SinglePointCalculator(atoms, **results)


def last_frame_step(path: str | Path, format: str | None = None) -> int | None:
    """``info["step"]`` of the file's last frame; None when there is no file or no frame.
    An unreadable file (a frame cut short) is an `InputError` naming it."""
    import ase.io

    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return None
    try:
        last = ase.io.read(str(path), index=-1, format=format or _format_for(path))
    except Exception as exc:  # noqa: BLE001 - any reader error: the file cannot be continued
        raise InputError(
            f"trajectory {str(path)!r} cannot be continued: it does not read as a trajectory "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:120]}); give another "
            "--trajectory path"
        ) from None
    step = last.info.get("step")
    return int(step) if step is not None else None


def _format_for(path: Path) -> str:
    return "traj" if path.suffix == ".traj" else "extxyz"
