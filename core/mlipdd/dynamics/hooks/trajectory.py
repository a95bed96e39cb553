"""Write frames (positions, velocities, forces, energy) with ase.io, one flush per frame."""

from __future__ import annotations

from pathlib import Path

from mlipdd.dynamics.base import DynamicsStage


class TrajectoryWriter:
    """Append a frame every ``frequency`` steps (and the starting frame) to ``path``.

    The format follows the suffix: ``.traj`` (ASE trajectory) or anything ase.io
    writes, extxyz by default. The file is flushed after every frame, so a crash loses
    nothing already written. A batch of several systems writes one frame per system
    per step, tagged with ``atoms.info["system"]``; ``info`` also holds ``step`` and
    ``time_fs``. Positions are unwrapped (NOTE [unwrapped frames]). The file is opened at the first frame (truncating an old one) and
    closed at the end of the run; a later run appends.

    Only the root rank writes. Under domain decomposition register this writer where
    it sees the gathered system (the distributed runtime's rank-zero scope).
    """

    stage = (DynamicsStage.BEFORE_RUN, DynamicsStage.AFTER_STEP, DynamicsStage.AFTER_RUN)

    def __init__(self, path: str | Path, frequency: int = 10, format: str | None = None):
        self.path = Path(path)
        self.frequency = int(frequency)
        self.format = format or _format_for(self.path)
        self.frames_written = 0
        self._handle = None
        self._last_step: int | None = None

    def __call__(self, ctx, stage) -> None:
        if not ctx.dynamics.reduce.is_root:
            return
        if stage is DynamicsStage.AFTER_RUN:
            self.close()
            return
        if ctx.step == self._last_step:
            return
        self._last_step = ctx.step
        batch = ctx.batch
        # NOTE [unwrapped frames]: ranks wrap atoms into the cell when they migrate (the
        # crossings are counted in ``image``); one process never wraps. Frames hold the
        # unwrapped positions, so a file is the same at any rank count and MSD works.
        unwrapped = batch.node.get("unwrapped_positions")
        for s, atoms in enumerate(batch.to_ase()):
            if unwrapped is not None:
                atoms.positions = unwrapped[batch.batch == s].detach().cpu().numpy()
            atoms.info.update(step=ctx.step, time_fs=ctx.time_fs, system=s)
            self._write(atoms)

    def _write(self, atoms) -> None:
        if self.format == "traj":
            from ase.io.trajectory import Trajectory

            if self._handle is None:
                mode = "a" if self.frames_written else "w"
                self._handle = Trajectory(str(self.path), mode)
            self._handle.write(atoms)
            # ASE syncs the frame index itself; pushing the bytes to the OS is ours
            fd = getattr(self._handle.backend, "fd", None)
            if fd is not None:
                fd.flush()
        else:
            import ase.io

            if self._handle is None:
                mode = "a" if self.frames_written else "w"
                self._handle = open(self.path, mode, encoding="utf-8")  # noqa: SIM115
            ase.io.write(self._handle, atoms, format=self.format)
            self._handle.flush()
        self.frames_written += 1

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def _format_for(path: Path) -> str:
    return "traj" if path.suffix == ".traj" else "extxyz"
