"""Output files that cannot be written: found before the run, or named in one line.

Before the run (`check_outputs_writable`), each output's directory is created if missing
and a scratch file is made in it, so a read-only or missing directory stops the run at
step 0 (as LAMMPS does for a dump file), not at the first checkpoint hours later.
During the run, a full disk (ENOSPC), a file-size limit (EFBIG) or a quota (EDQUOT)
surfaces from a writer as a bare ``OSError`` without a file name, sometimes under torch's
zip-writer ``RuntimeError``; `write_error_message` finds it in the exception chain and
names the output by the writer module that raised it. The writers themselves stay as they
are: this is the command line's report, nothing is retried.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path

from mlipdd.data import InputError

# setting -> what the user calls it
OUTPUTS = {
    "trajectory": "trajectory",
    "checkpoint": "checkpoint",
    "log_file": "thermo log",
    "thermo_csv": "thermo CSV",
}
# which module writes which outputs (for errors that carry no file name)
_WRITERS = {
    "mlipdd.dynamics.hooks.trajectory": ("trajectory",),
    "mlipdd.distributed.checkpoint": ("checkpoint",),
    "mlipdd.dynamics.hooks.thermo": ("log_file", "thermo_csv"),
}
_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}
WRITE_ERRNOS = _FULL | _DENIED | {errno.ENOENT, errno.ENOTDIR, errno.EISDIR}


def output_paths(cfg) -> dict[str, Path]:
    return {name: Path(getattr(cfg, name)) for name in OUTPUTS if getattr(cfg, name, None)}


def check_outputs_writable(cfg) -> None:
    """`InputError` naming the first output whose directory cannot take a new file."""
    for name, path in output_paths(cfg).items():
        what = f"{OUTPUTS[name]} {str(path)!r} (--{name.replace('_', '-')})"
        if path.is_dir():
            raise InputError(f"the {what} is a directory; give a file name")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path.parent, prefix=".mlipdd-write-test-"):
                pass
        except OSError as exc:
            raise InputError(f"cannot write the {what}: {_reason(exc)}") from None
        if path.exists() and not os.access(path, os.W_OK):
            raise InputError(f"cannot write the {what}: the file exists and is read-only; "
                             "make it writable or give another path")


def write_error_message(exc: BaseException, cfg) -> str | None:
    """One line for an output that failed to write during the run; None when ``exc`` is
    not such a failure (then it is a bug or something else, and keeps its traceback)."""
    outputs = output_paths(cfg)
    for link in _chain(exc):
        if not (isinstance(link, OSError) and link.errno in WRITE_ERRNOS):
            continue
        by_writer = _named_by_writer(link, exc, outputs)
        by_file = _named_by_file(link, outputs)
        names = ([n for n in by_file if n in by_writer] if len(by_file) > 1 and by_writer else None) \
            or by_file or by_writer
        if not names:
            return None
        what = " or ".join(f"{OUTPUTS[n]} {str(outputs[n])!r}" for n in names)
        return f"cannot write the {what}: {_reason(link)}"
    return None


def reported_by_failing_rank(text: str) -> bool:
    """A peer's view (`RemoteRankError` text, ``rank R failed: Kind: message``) of a failure
    the failing rank reports itself in one line: bad input (an `InputError` of any kind)
    or an output write. The peer then exits quietly with the same code."""
    found = re.match(r"rank \d+ failed: (\w+): ", text)
    if found and found.group(1) in _input_error_names():
        return True
    found = re.search(r"OSError: \[Errno (\d+)\]", text)
    return found is not None and int(found.group(1)) in WRITE_ERRNOS


def _input_error_names() -> set[str]:
    names, todo = set(), [InputError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _reason(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno, str(exc.errno))
    if exc.errno in _FULL:
        fix = "free disk space (or raise the quota / file-size limit, ulimit -f) or write elsewhere"
    elif exc.errno in _DENIED:
        fix = "the directory is not writable (read-only or another owner); give a writable path"
    else:
        fix = "give a path in an existing, writable directory"
    return f"{exc.strerror or exc} ({code}); {fix}"


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _named_by_file(exc: OSError, outputs: dict[str, Path]) -> list[str]:
    if not exc.filename:
        return []
    failed = Path(os.fsdecode(exc.filename)).resolve()
    exact = [n for n, p in outputs.items() if failed == p.resolve()]
    # a writer's temporary file beside its output (the checkpoint's atomic write)
    return exact or [n for n, p in outputs.items() if failed.parent == p.resolve().parent]


def _named_by_writer(link: BaseException, top: BaseException, outputs: dict[str, Path]) -> list[str]:
    for exc in (link, top):
        tb = exc.__traceback__
        modules = []
        while tb is not None:
            modules.append(tb.tb_frame.f_globals.get("__name__"))
            tb = tb.tb_next
        for module in reversed(modules):  # the innermost writer
            names = [n for n in _WRITERS.get(module, ()) if n in outputs]
            if names:
                return names
    return []
