"""A one-line progress display on stderr for long runs."""

from __future__ import annotations

import sys
import time
from typing import IO

from mlipdd.dynamics.base import DynamicsStage


class ProgressBar:
    """Shows ``step n/N, steps/s, ETA`` on ``stream`` (stderr), at most every ``interval`` s.

    Stays silent for runs expected to end within ``min_seconds`` of wall time, so
    short runs and tests print nothing. Only the root rank prints.
    """

    stage = (DynamicsStage.BEFORE_RUN, DynamicsStage.AFTER_STEP, DynamicsStage.AFTER_RUN)
    frequency = 1

    def __init__(
        self,
        stream: IO[str] | None = None,
        min_seconds: float = 5.0,
        width: int = 30,
        interval: float = 1.0,
    ):
        self.stream = stream or sys.stderr
        self.min_seconds = float(min_seconds)
        self.width = int(width)
        self.interval = float(interval)
        self._start = self._last_draw = 0.0
        self._first_step = 0
        self._drawn = False

    def __call__(self, ctx, stage) -> None:
        if not ctx.dynamics.reduce.is_root:
            return
        now = time.perf_counter()
        if stage is DynamicsStage.BEFORE_RUN:
            self._start, self._last_draw, self._first_step, self._drawn = now, now, ctx.step, False
            return
        if stage is DynamicsStage.AFTER_RUN:
            if self._drawn:
                self.stream.write("\n")
                self.stream.flush()
            return
        done, total = ctx.step - self._first_step, ctx.dynamics.target_step - self._first_step
        elapsed = now - self._start
        if done <= 0 or total <= 0 or now - self._last_draw < self.interval:
            return
        rate = done / elapsed
        remaining = (total - done) / rate
        if not self._drawn and elapsed + remaining < self.min_seconds:
            return
        self._last_draw, self._drawn = now, True
        filled = int(self.width * done / total)
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(
            f"\r[{bar}] step {ctx.step}/{ctx.dynamics.target_step} {rate:8.1f} steps/s ETA {remaining:6.1f}s"
        )
        self.stream.flush()
