"""``--system FILE``: a structure file read the way a user expects, or one line saying why not.

* a file ASE cannot read (truncated, wrong format, text in a number's place) is bad input
  naming the file and ASE's complaint, never ASE's traceback;
* a file with several frames (a trajectory) runs its first frame and says so; ``--frame N``
  picks another (``-1`` the last, to continue from where a trajectory ended);
* a molecule or cluster without a box gets one with vacuum (`mlipdd.vacuum_box`), at any
  number of ranks, so that the outputs do not depend on it; said in one line.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

from mlipdd.data import Batch, InputError
from mlipdd.vacuum_box import box_open_systems, boxed_message

# Angstrom on each side of a boxed molecule or cluster: the box is not periodic, so this only
# needs to keep atoms that move inside the box the ranks split (ASE's center(vacuum=...) habit)
OPEN_SYSTEM_VACUUM = 10.0


def read_structure(path: Path, size: int | None, dtype, device, frame: int | None = None) -> Batch:
    """The starting structure from ``path`` (frame ``frame``; None: the first, said when the
    file holds more), repeated ``size`` times along its periodic axes, boxed if open."""
    from mlipdd.lattices import SYSTEMS

    if not path.is_file():
        raise InputError(
            f"system {str(path)!r} is neither a built-in ({sorted(SYSTEMS)}) nor an existing file"
        )
    atoms = _read_frame(path, frame)
    if size is not None and int(size) > 1:
        atoms = atoms.repeat([int(size) if p else 1 for p in atoms.pbc])
    batch = Batch.from_ase(atoms, dtype=dtype, device=device)
    boxed = box_open_systems(batch, OPEN_SYSTEM_VACUUM)
    if boxed:
        say(boxed_message(boxed, OPEN_SYSTEM_VACUUM))
    return batch


def _read_frame(path: Path, frame: int | None):
    import ase.io

    try:
        if frame is not None:
            return ase.io.read(str(path), index=int(frame))
        first_two = list(itertools.islice(ase.io.iread(str(path)), 2))
    except (IndexError, StopIteration):  # ASE's readers differ in how they say it
        raise InputError(f"{path} has no frame {frame}; count from 0 (-1: the last)") from None
    except Exception as exc:  # noqa: BLE001 - whatever ASE's reader raised, the file is unreadable
        text = (str(exc).strip().splitlines() or [""])[0][:200]
        raise InputError(
            f"cannot read the structure file {path}: {type(exc).__name__}: {text}; check that it is "
            "whole and in a format ASE reads (its extension names the format)"
        ) from None
    if not first_two:
        raise InputError(f"{path} holds no structure; give a file with at least one frame")
    if len(first_two) > 1:
        say(f"{path} holds several frames: running the first (--frame N picks another, -1 the last)")
    return first_two[0]


def say(line: str) -> None:
    print(f"mlipdd run: {line}", file=sys.stderr, flush=True)
