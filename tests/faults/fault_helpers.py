"""Start ``mlipdd run`` as a user would (a real launcher process and its ranks) and poke it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# 108 LJ argon atoms, quiet, on the CPU: enough for 2 ranks to each own a slab
SMALL_RUN = ["--size", "3", "--log-every", "0", "--progress", "off", "--device", "cpu"]
LONG = ["--steps", "1000000"]  # runs until a test stops it


def mlipdd_command(*args: str, failure_grace_s: float | None = None,
                   kill_after_s: float | None = None) -> list[str]:
    """The installed ``mlipdd`` command. ``failure_grace_s`` / ``kill_after_s`` shorten the
    launcher's waits (`mlipdd.distributed.supervise`: 15 s for the other ranks of a failed
    run to stop by themselves, 5 s from SIGTERM to SIGKILL) in the launcher process only,
    for cases that wait them out on purpose: a rank that cannot stop by itself (suspended,
    or left at the rendezvous) is ended by the launcher all the same, only sooner."""
    patch = ""
    if failure_grace_s is not None or kill_after_s is not None:
        patch = "import mlipdd.distributed.supervise as s; "
        if failure_grace_s is not None:
            patch += f"s.FAILURE_GRACE_S = {float(failure_grace_s)!r}; "
        if kill_after_s is not None:
            patch += f"s.KILL_AFTER_S = {float(kill_after_s)!r}; "
    return [
        sys.executable,
        "-c",
        f"import sys; {patch}from mlipdd.cli import main; sys.exit(main())",
        *args,
    ]


def program_env() -> dict[str, str]:
    """The environment of a user's program a test starts: one thread, and without a
    ``MLIPDD_SPAWN_PRELOAD`` the developer's shell may export (the conftests preload the
    model packages in pytest's process only): a calculator in the program would import
    them all in its forkserver first, 15.6 s for the 2-rank LJ script here instead of 4.0 s
    with mace, fairchem and aimnet listed."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MLIPDD_SPAWN_PRELOAD", None)
    return env


def start_run(tmp_path: Path, *args: str, **launcher_waits: float) -> subprocess.Popen:
    """``mlipdd run ARGS`` in ``tmp_path``; stdout/stderr go to files there.
    ``launcher_waits``: `mlipdd_command`'s ``failure_grace_s`` / ``kill_after_s``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        mlipdd_command("run", *args, **launcher_waits),
        cwd=tmp_path,
        env=env,
        stdout=open(tmp_path / "stdout.txt", "w"),
        stderr=open(tmp_path / "stderr.txt", "w"),
        start_new_session=True,  # the test's own signals stay off the run
    )


def stderr_of(tmp_path: Path) -> str:
    return (tmp_path / "stderr.txt").read_text()


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def rank_pids(launcher: subprocess.Popen, n: int, timeout: float = 120.0) -> list[int]:
    """The launcher's ``n`` rank processes, in rank order (they are started in order)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = children(launcher.pid)
        if len(pids) == n:
            return pids
        assert launcher.poll() is None, stderr_of_process(launcher)
        time.sleep(0.05)
    raise AssertionError(f"the launcher did not start {n} ranks within {timeout} s")


def stderr_of_process(process: subprocess.Popen) -> str:
    return f"the run ended early with code {process.returncode}"


def wait_for_file(path: Path, process: subprocess.Popen, timeout: float = 180.0) -> None:
    """Until ``path`` exists and is not empty (e.g. the first trajectory frame)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size > 0:
            return
        assert process.poll() is None, f"the run ended early with code {process.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear within {timeout} s")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has finished; only its exit status is left


def wait_gone(pids: list[int], timeout: float) -> float:
    """Seconds until every pid has ended; fails after ``timeout``."""
    start = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - start > timeout:
            left = [p for p in pids if alive(p)]
            for p in left:  # do not leave them behind for the next test
                os.kill(p, signal.SIGKILL)
            raise AssertionError(f"processes {left} still ran {timeout} s later")
        time.sleep(0.05)
    return time.monotonic() - start


def finish(process: subprocess.Popen, timeout: float) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"the launcher was still running {timeout} s later") from None


def run_here(capfd, cwd: Path, *args: str) -> tuple[int, str]:
    """``mlipdd run ARGS`` through `mlipdd.cli.main` in this process, in ``cwd``: (exit code,
    stderr). With ``--nproc N`` the ranks are real processes (they write to this process's
    stderr); only the launcher's own interpreter start is saved (a torch import and a plugin
    load), for cases that are about the ranks' answer, not about the launcher."""
    from mlipdd.cli import main

    capfd.readouterr()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        code = main(["run", *args])
    finally:
        os.chdir(before)
    return code, capfd.readouterr().err
