"""A file system that refuses a trajectory frame mid-write (catalogue entry O3).

Before: a half frame was left behind (the file no longer read) and the run ended with a
traceback. The refusal here is the kernel's, not a mock: the run is started under a
file-size limit (``RLIMIT_FSIZE``), so a write that would grow a file past it fails with
EFBIG, as a full disk fails with ENOSPC or a quota with EDQUOT, part way through a frame.
Frames are written whole or not at all (NOTE [whole frames] in
`mlipdd.dynamics.hooks.trajectory`), and the error is one line naming the file.
"""

from __future__ import annotations

import os
import resource
import subprocess

import ase.io
import pytest
from fault_helpers import SMALL_RUN, mlipdd_command

LIMIT = 60_000  # bytes: a few 108-atom frames, whatever the format


def _limited():
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("suffix", ["extxyz", "traj"])
def test_a_refused_frame_leaves_whole_frames_and_one_line(tmp_path, suffix, nproc):
    path = tmp_path / f"md.{suffix}"
    out = subprocess.run(
        mlipdd_command("run", "--nproc", str(nproc), *SMALL_RUN, "--steps", "60",
                       "--trajectory", str(path), "--trajectory-every", "2"),
        cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=_limited,
        capture_output=True, text=True, timeout=240, check=False,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert str(path) in lines[0] and "File too large" in lines[0], lines
    frames = ase.io.read(path, ":")  # reads: no half frame at the end
    assert frames and all(len(f) == 108 for f in frames)
    assert [f.info["step"] for f in frames] == list(range(0, 2 * len(frames), 2))
    assert f"keeps its {len(frames)} whole frame(s)" in lines[0]
    assert path.stat().st_size <= LIMIT
