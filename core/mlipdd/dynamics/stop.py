"""Stopping a run cleanly on request (SIGTERM, SIGHUP, SIGINT, a dead launcher).

# NOTE [clean stop]
A signal can arrive at any point of a step, on any rank. Stopping on the spot would
leave half a step behind and, under domain decomposition, the other ranks waiting in a
collective. So a signal only *records* a request (`request_stop`); the integrator looks
at it between steps and, when it watches for requests, every rank agrees on it through
``dynamics.reduce.any`` (one tiny all-reduce per step), so all ranks stop after the
same step. They then fire AFTER_RUN together (the trajectory writer closes its file, a
checkpoint writer saves the last state) and raise `RunStopped`.

The per-step agreement costs a collective, so it only happens while requests are being
watched (`stop_on_signals`), which every rank of a run must do alike (``mlipdd run``
does it on every rank). A second signal while a stop is pending is not caught: the
default action (termination, or KeyboardInterrupt for SIGINT) takes over -- unless it
comes within `STOP_BURST_S` of the first: a scheduler's stop (``scancel``, a time limit)
signals every process of the job, and the launcher (ours, torchrun, srun) forwards its own
signal to each rank too, so each rank gets two within milliseconds; they are one request,
and a rank must not give up its clean stop (checkpoint, whole frames) because of it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

_lock = threading.Lock()
_request: str | None = None
_signal_number: int | None = None
_watchers = 0
_signals_seen = 0
_first_signal_at: float | None = None
# signals this soon after the first are the same request (NOTE [clean stop]): a scheduler
# and a forwarding launcher deliver theirs milliseconds apart; a person's second Ctrl-C,
# meant as "give up", comes later
STOP_BURST_S = 1.0


class RunStopped(Exception):
    """The run stopped after ``step`` because a stop was requested (``reason``).

    Every rank raises it after the same step (the request was agreed), so fail-together
    code lets it through unchanged (``raised_on_every_rank``).
    """

    raised_on_every_rank = True

    def __init__(self, step: int, reason: str, signal_number: int | None = None):
        self.step = int(step)
        self.reason = reason
        self.signal_number = signal_number
        super().__init__(f"stopped after step {step}: {reason}")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process ended by that signal."""
        return 128 + int(self.signal_number or signal.SIGTERM)


def request_stop(reason: str, signal_number: int | None = None) -> None:
    """Ask the running integrator to stop after the current step (thread- and signal-safe)."""
    global _request, _signal_number
    with _lock:
        if _request is None:
            _request, _signal_number = reason, signal_number


def stop_requested() -> str | None:
    """The reason of a pending request, or None."""
    return _request


def requested_signal() -> int | None:
    return _signal_number


def watching() -> bool:
    """Whether integrators check for requests between steps (see NOTE [clean stop])."""
    return _watchers > 0


def clear() -> None:
    global _request, _signal_number, _signals_seen, _first_signal_at
    with _lock:
        _request = _signal_number = _first_signal_at = None
        _signals_seen = 0


def repeats_first_signal(now: float, first_at: float | None) -> bool:
    """Whether a signal at ``now`` belongs to the burst of the first (at ``first_at``)."""
    return first_at is not None and now - first_at < STOP_BURST_S


def _on_signal(signum, frame) -> None:
    global _signals_seen, _first_signal_at
    name = signal.Signals(signum).name
    now = time.monotonic()
    if repeats_first_signal(now, _first_signal_at):
        return  # the same stop, delivered twice (NOTE [clean stop])
    _signals_seen += 1
    if _signals_seen == 1:
        _first_signal_at = now
    if _signals_seen > 1:  # a second signal: give up on the clean stop
        signal.signal(signum, signal.SIG_DFL)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.raise_signal(signum)
        return
    request_stop(f"{name} received", signum)


@contextlib.contextmanager
def stop_on_signals(signals=STOP_SIGNALS):
    """Within the block, ``signals`` request a clean stop instead of killing the process.

    Main thread only (Python's rule for signal handlers). Every rank of a distributed run
    must enter it, since watching adds a per-step agreement (a collective).
    """
    global _watchers
    previous = {s: signal.signal(s, _on_signal) for s in signals}
    _watchers += 1
    try:
        yield
    finally:
        _watchers -= 1
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def watch_requests():
    """Watch for requests without installing signal handlers (a thread may request)."""
    global _watchers
    _watchers += 1
    try:
        yield
    finally:
        _watchers -= 1
