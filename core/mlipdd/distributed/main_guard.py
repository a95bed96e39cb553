"""Can this program start spawned ranks? The two ways it cannot, caught before a hang.

A spawned rank (multiprocessing's "spawn") first re-imports the parent's main program
(as ``__mp_main__``) so that objects defined there can be unpickled. So:

* a script that creates a calculator at top level, without ``if __name__ == "__main__":``,
  creates it again inside every rank while the rank is still being set up; the rank
  would start ranks of its own (multiprocessing refuses, deep in its bootstrap, or the
  ranks wait forever for peers). `refuse_in_rank_bootstrap` ends such a rank at once
  with `MAIN_REIMPORT_EXIT_CODE`, which the parent turns into the fix;
* a program read from stdin (``python - < script.py``, ``cat script.py | python``) has
  no file to re-import; `check_spawn_can_start` refuses it in the parent, before any
  process starts.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

MAIN_REIMPORT_EXIT_CODE = 86  # a rank that found itself re-running the parent's main code

_FIX = (
    'put the code that creates the calculator (or RankPool, or TorchSimModel with nproc > 1) '
    'under `if __name__ == "__main__":` in a script file and run that file; spawned ranks '
    "re-import the main program, so its top level must not start ranks"
)


def unguarded_main_message() -> str:
    return ("the main program creates ranks at import time (no `if __name__ == \"__main__\":` "
            f"guard): every rank re-ran it while starting; {_FIX}")


def in_rank_bootstrap() -> bool:
    """True while a spawned process is still importing its parent's main program."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def check_spawn_can_start(model=None) -> None:
    """Call before starting ranks: ends a rank re-running unguarded main code; refuses a main
    program that spawned ranks cannot re-import (stdin), and a model (or factory) defined in
    a main program that has no file (``python -c``, a notebook): the ranks could not find it."""
    if in_rank_bootstrap():
        # a rank of ours, re-running the parent's top-level code: say nothing here (the
        # parent says it once), end before any import or rank start of the user's code
        sys.stderr.flush()
        os._exit(MAIN_REIMPORT_EXIT_CODE)
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__spec__", None) is not None:
        return  # python -m module: re-imported by name
    path = getattr(main, "__file__", None)
    if path is not None and not os.path.isfile(path):
        raise RuntimeError(
            f"the main program was read from {path!r}, not from a file, so spawned ranks cannot "
            f"import it; save it to a file and {_FIX}"
        )
    defined_in_main = getattr(model, "__module__", None) == "__main__" or type(model).__module__ == "__main__"
    if path is None and defined_in_main:
        raise RuntimeError(
            f"{getattr(model, '__qualname__', type(model).__qualname__)} is defined in a main program "
            "that has no file (python -c, a notebook, the interactive prompt), so the ranks cannot "
            "import it; define the model class (or factory) in a module and import it from there"
        )
