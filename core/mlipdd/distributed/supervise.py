"""Supervising local ranks: they live and die with their launcher, and a dead one is named.

Launcher side (`start_rank`, `Supervisor`), for ``mlipdd run --nproc N``:

* each rank runs in its own session, so a Ctrl-C in the terminal reaches the launcher
  only, which turns it (and SIGTERM, SIGHUP) into one SIGTERM per rank: the ranks stop
  together after the same step, close the trajectory and write the checkpoint (NOTE
  [clean stop] in `mlipdd.dynamics.stop`). Ranks still alive after `STOP_GRACE_S`, or
  at a second signal (one more than `STOP_BURST_S` after the first: a scheduler's
  signal forwarded by srun arrives twice at once), are killed;
* when a rank fails, the others get `FAILURE_GRACE_S` to fail together by themselves
  (they normally do within a second), then they are terminated, then killed;
* at the end the failing rank is named with its exit code or signal (the first to
  fail is marked as the root cause, as torchrun does) and the launcher exits with a
  small code: 0 done, 1 a rank failed, 2 bad input (every failing rank said so),
  128 + N stopped by signal N.

Rank side (`follow_launcher`): the kernel sends the rank SIGTERM when its launcher dies,
even by SIGKILL (``prctl(PR_SET_PDEATHSIG)``, Linux), and a watchdog thread checks the
parent anyway (other systems, or a launcher that died before the prctl): a rank whose
launcher is gone stops cleanly, or exits after `STOP_GRACE_S` if it cannot (blocked in
a collective with a dead peer).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

LAUNCHER_PID_ENV = "MLIPDD_LAUNCHER_PID"
STOP_GRACE_S = 30.0  # ranks asked to stop get this long to finish a step and write files
FAILURE_GRACE_S = 15.0  # after one rank failed, the others get this long to stop by themselves
KILL_AFTER_S = 5.0  # a rank terminated by the launcher gets this long before SIGKILL
EXIT_FAILED, EXIT_INPUT = 1, 2
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


# ---- launcher side ------------------------------------------------------------------------
def start_rank(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """One rank in its own session, told who its launcher is (see `follow_launcher`)."""
    env = {**env, LAUNCHER_PID_ENV: str(os.getpid())}
    return subprocess.Popen(command, env=env, start_new_session=True)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (signal {-code})"
    return f"exited with code {code}"


def _is_stop_code(code: int) -> bool:
    return code in {128 + s for s in _STOP_SIGNALS}


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen
    code: int | None = None
    ended: int | None = None  # order in which the launcher saw it end
    terminated_by_launcher: bool = False
    suspended: bool = False  # stopped (SIGSTOP, Ctrl-Z) when the launcher had to end it
    signalled: bool = False  # the launcher has sent it a signal


class Supervisor:
    """Start the ranks; forward stop signals; stop the others when one fails; report.

    The stop signals are caught from before the first rank starts (`catching_signals`):
    a SIGTERM between two ``Popen`` calls would otherwise end the launcher by the default
    action, leaving the started ranks to their parent-death signal and exit code -15.
    """

    def __init__(self, stream=None):
        self.ranks: list[_Rank] = []
        self.stream = stream if stream is not None else sys.stderr
        self.stop_signal: int | None = None
        self._stop_at: float | None = None
        self._failed_at: float | None = None
        self._terminated_at: float | None = None
        self._ends = 0
        self._failed_before_stop = False

    # starting ----------------------------------------------------------------------------
    def start(self, command: list[str], env: dict[str, str]) -> None:
        """Start the next rank, unless a stop signal came first."""
        if self.stop_signal is not None:
            return
        rank = _Rank(len(self.ranks), start_rank(command, env))
        self.ranks.append(rank)
        if self.stop_signal is not None and not rank.signalled:  # came before it was listed
            with contextlib.suppress(ProcessLookupError):
                rank.process.send_signal(signal.SIGTERM)

    # signals -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def catching_signals(self):
        previous = {s: signal.signal(s, self._on_signal) for s in _STOP_SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        from mlipdd.dynamics.stop import repeats_first_signal

        if self.stop_signal is not None:
            if repeats_first_signal(time.monotonic(), self._stop_at):
                return  # one stop delivered twice (a scheduler and srun): NOTE [clean stop]
            self._send(signal.SIGKILL)  # a later second signal: no more patience
            return
        self.stop_signal, self._stop_at = signum, time.monotonic()
        self._failed_before_stop = self._failed_at is not None
        self._say(
            f"{signal.Signals(signum).name} received: stopping every rank after its current step"
        )
        self._send(signal.SIGTERM)

    def _send(self, sig: int, mark: bool = False) -> None:
        for r in self.ranks:
            if r.process.poll() is None:
                if mark and not r.terminated_by_launcher:
                    r.suspended = _process_state(r.process.pid) == "T"
                r.terminated_by_launcher |= mark
                r.signalled = True
                with contextlib.suppress(ProcessLookupError):
                    r.process.send_signal(sig)

    # waiting -----------------------------------------------------------------------------
    def wait(self, poll_s: float = 0.05) -> int:
        """Until every started rank has ended (call inside `catching_signals`)."""
        while not self._poll():
            self._escalate(time.monotonic())
            time.sleep(poll_s)
        return self._report()

    def _poll(self) -> bool:
        newly = []
        for r in self.ranks:
            if r.code is None and r.process.poll() is not None:
                r.code = r.process.returncode
                newly.append(r)
        # ranks seen ending in the same poll: one killed by a signal is the likelier cause
        for r in sorted(newly, key=lambda r: (r.code >= 0, r.rank)):
            r.ended = self._ends
            self._ends += 1
            if self._failed_at is None and self._is_failure(r):
                self._failed_at = time.monotonic()
        return all(r.code is not None for r in self.ranks)

    def _is_failure(self, r: _Rank) -> bool:
        if r.code == 0 or (_is_stop_code(r.code) and not r.terminated_by_launcher):
            return False
        # asked to stop by a signal to the launcher: a rank still starting up (no handler
        # yet) ends by that SIGTERM, one past the stop grace by SIGKILL; both as asked
        asked = self.stop_signal is not None and not self._failed_before_stop
        return not (asked and r.code in (-signal.SIGTERM, -signal.SIGKILL))

    def _escalate(self, now: float) -> None:
        if self._terminated_at is None:
            if self._failed_at is not None and now - self._failed_at > FAILURE_GRACE_S:
                self._send(signal.SIGTERM, mark=True)
                self._terminated_at = now
            elif self._stop_at is not None and now - self._stop_at > STOP_GRACE_S:
                self._say(
                    f"ranks still running {STOP_GRACE_S:.0f} s after the stop signal: killing them"
                )
                self._send(signal.SIGKILL, mark=True)
                self._terminated_at = now
        elif now - self._terminated_at > KILL_AFTER_S:
            self._send(signal.SIGKILL, mark=True)

    # the verdict -------------------------------------------------------------------------
    def _report(self) -> int:
        # the root cause: a suspended rank (the others timed out on it), else the first to end
        failed = sorted(
            (r for r in self.ranks if self._is_failure(r)), key=lambda r: (not r.suspended, r.ended)
        )
        if not failed:
            if self.stop_signal is not None:
                return 128 + self.stop_signal
            stop_codes = [r.code for r in self.ranks if r.code != 0]
            return stop_codes[0] if stop_codes else 0
        if self.stop_signal is None and all(r.code == EXIT_INPUT for r in failed):
            return EXIT_INPUT  # bad input: rank 0 has said what and how to fix it
        first = failed[0]
        for r in failed:
            if r is first:
                note = " (the root cause)" if len(failed) > 1 else ""
                if r.suspended:
                    note = (
                        " (it was suspended, e.g. by SIGSTOP: the others waited for it until "
                        "the collective timeout)"
                    )
            elif r.terminated_by_launcher:
                note = " (ended by the launcher once another rank had failed)"
            else:
                note = ""
            self._say(f"rank {r.rank} (pid {r.process.pid}) {describe_exit(r.code)}{note}")
        return EXIT_FAILED

    def _say(self, text: str) -> None:
        print(f"mlipdd run: {text}", file=self.stream, flush=True)


def _process_state(pid: int) -> str | None:
    """The one-letter state of a process (Linux /proc), e.g. "T" when it is stopped."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


# ---- rank side ----------------------------------------------------------------------------
def follow_launcher(grace_s: float = STOP_GRACE_S, poll_s: float = 0.5) -> None:
    """In a rank started by `start_rank`: stop when the launcher dies (see the module doc).

    Call it first thing in the rank, before the slow imports. Does nothing in a process
    that no mlipdd launcher started.
    """
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if not pid:
        return
    launcher = int(pid)
    if not signal_on_parent_death(launcher, signal.SIGTERM):
        print(
            f"rank {os.environ.get('RANK', '?')}: the launcher (pid {launcher}) is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signal.SIGTERM)
    thread = threading.Thread(
        target=_watch_launcher,
        args=(launcher, grace_s, poll_s),
        name="mlipdd-launcher-watchdog",
        daemon=True,
    )
    thread.start()


def signal_on_parent_death(parent_pid: int, sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux); returns
    False when the parent ``parent_pid`` is already gone (it died before the request took
    effect), so the caller exits at once."""
    if sys.platform.startswith("linux"):  # elsewhere the caller's own watch covers it
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return os.getppid() == parent_pid


def _watch_launcher(launcher: int, grace_s: float, poll_s: float) -> None:
    from mlipdd.dynamics import stop

    while os.getppid() == launcher:
        time.sleep(poll_s)
    stop.request_stop(f"the launcher (pid {launcher}) ended", signal.SIGTERM)
    time.sleep(grace_s)
    print(
        f"rank {os.environ.get('RANK', '?')}: the launcher ended and this rank could not stop "
        f"cleanly within {grace_s:.0f} s (blocked in a collective?); exiting",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signal.SIGTERM)
