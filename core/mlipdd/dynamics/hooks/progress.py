"""Progress of a run on stderr: a tqdm bar on a terminal, plain periodic lines otherwise
(a log file gets whole lines, never ``\\r`` frames)."""

from __future__ import annotations

import sys
import time
from typing import IO

from mlipdd.dynamics.base import DynamicsStage


class ProgressBar:
    """Shows progress on ``stream`` (stderr). Only the root rank prints.

    On a terminal (``stream.isatty()``): a tqdm bar (steps, steps/s, ETA). Otherwise one
    plain line every ``interval`` seconds (``step 500/1000 (50%), 12.3 steps/s, ETA 41 s``)
    and one at the end, for runs longer than ``interval``.
    """

    stage = (DynamicsStage.BEFORE_RUN, DynamicsStage.AFTER_STEP, DynamicsStage.AFTER_RUN)
    frequency = 1

    def __init__(self, stream: IO[str] | None = None, interval: float = 10.0):
        self.stream = stream or sys.stderr
        self.interval = float(interval)
        self.bar = None
        self._start = self._last_line = 0.0
        self._first_step = 0
        self._printed = False

    @property
    def interactive(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def write(self, text: str, file: IO[str]) -> None:
        """Print whole lines to ``file`` without tearing the bar (thermo lines on a terminal)."""
        if self.bar is None:
            file.write(text)
            file.flush()
            return
        from tqdm import tqdm

        tqdm.write(text.rstrip("\n"), file=file)

    def __call__(self, ctx, stage) -> None:
        if not ctx.dynamics.reduce.is_root:
            return
        now = time.perf_counter()
        target = ctx.dynamics.target_step
        if stage is DynamicsStage.BEFORE_RUN:
            self._start = self._last_line = now
            self._first_step, self._printed = ctx.step, False
            if self.interactive:
                from tqdm import tqdm

                self.bar = tqdm(total=target - ctx.step, file=self.stream, unit="step",
                                dynamic_ncols=True, leave=True)
            return
        if stage is DynamicsStage.AFTER_RUN:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            elif self._printed or now - self._start >= self.interval:
                self._line(ctx.step, target, now)
            return
        if self.bar is not None:
            self.bar.update(ctx.step - self._first_step - self.bar.n)
        elif now - self._last_line >= self.interval:
            self._line(ctx.step, target, now)

    def _line(self, step: int, target: int, now: float) -> None:
        done, total = step - self._first_step, max(1, target - self._first_step)
        rate = done / max(now - self._start, 1e-9)
        eta = (total - done) / rate if rate > 0 else float("inf")
        self.stream.write(f"step {step}/{target} ({100 * done / total:.0f}%), {rate:.1f} steps/s, "
                          f"ETA {eta:.0f} s\n")
        self.stream.flush()
        self._last_line, self._printed = now, True
