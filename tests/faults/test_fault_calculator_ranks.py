"""The calculator's ranks killed, stopped or hung mid-call, and scripts that cannot start
ranks (issue 25 items 9 and 10): the call raises naming the rank, the other ranks are
killed at once, the next call starts new ranks; a script without a main guard (or code
read from stdin) is refused with the fix instead of blocking in process start-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from ase.build import bulk
from calculator_models import ARGON, SlowOnRank
from fault_helpers import program_env
from mlipdd.ase import MLIPDDCalculator, WorkerError
from mlipdd.models import LennardJones


def argon():
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(2)
    atoms.rattle(0.1, seed=3)
    return atoms


def stretched():
    atoms = argon()
    atoms.set_cell(atoms.cell * 1.01, scale_atoms=True)
    return atoms


SLOW_VOLUME = argon().get_volume() * 1.02  # a stretched() cell (x 1.03) is slow on that rank


def energy(calc, atoms=None):
    atoms = (atoms or argon()).copy()
    atoms.calc = calc
    return atoms.get_potential_energy()


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def reference():
    return energy(MLIPDDCalculator(LennardJones(**ARGON)))


def test_a_rank_killed_mid_call_is_named_and_the_other_killed_at_once(reference):
    """Rank 0 is busy (asleep 20 s inside the call) when rank 1 is SIGKILLed (was broken: the
    report named no rank, or the wrong one, and the survivor lived on until close())."""
    with MLIPDDCalculator(SlowOnRank(rank=0, volume=SLOW_VOLUME, seconds=20), nproc=2) as calc:
        energy(calc)
        pids = calc.worker_pids
        threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(WorkerError, match=rf"rank 1 \(pid {pids[1]}\) was killed by SIGKILL \(signal 9\)"):
            energy(calc, stretched())
        assert time.monotonic() - start < 10  # not the 20 s rank 0 sleeps
        assert all(gone(pid) for pid in pids)
        assert energy(calc) == pytest.approx(reference, rel=1e-12)  # new ranks
        assert not set(calc.worker_pids) & set(pids)


def test_a_rank_killed_between_calls_is_named_in_a_warning_and_replaced(reference):
    with MLIPDDCalculator(LennardJones(**ARGON), nproc=2) as calc:
        energy(calc)
        pids = calc.worker_pids
        os.kill(pids[0], signal.SIGKILL)
        time.sleep(0.5)
        with pytest.warns(RuntimeWarning, match=rf"rank 0 \(pid {pids[0]}\) was killed by SIGKILL"):
            assert energy(calc, stretched()) == pytest.approx(energy(MLIPDDCalculator(LennardJones(**ARGON)), stretched()), rel=1e-12)
        assert all(gone(pid) for pid in pids) and len(set(calc.worker_pids) - set(pids)) == 2


def test_a_stopped_rank_fails_the_call_naming_it(reference):
    """SIGSTOP (was broken: the call waited forever)."""
    with MLIPDDCalculator(LennardJones(**ARGON), nproc=2) as calc:
        energy(calc)
        pids = calc.worker_pids
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=rf"rank 1 \(pid {pids[1]}\) is stopped"):
            energy(calc, stretched())
        assert time.monotonic() - start < 15
        assert all(gone(pid) for pid in pids)
        assert energy(calc) == pytest.approx(reference, rel=1e-12)


def test_a_hung_rank_fails_the_call_at_its_timeout(reference):
    with MLIPDDCalculator(SlowOnRank(rank=1, volume=SLOW_VOLUME, seconds=60), nproc=2, timeout=2) as calc:
        energy(calc)
        pids = calc.worker_pids
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) did not answer within"):
            energy(calc, stretched())
        assert time.monotonic() - start < 20
        assert all(gone(pid) for pid in pids)
        assert energy(calc) == pytest.approx(reference, rel=1e-12)


_UNGUARDED = """
from ase.build import bulk
from mlipdd.ase import MLIPDDCalculator
from mlipdd.models import LennardJones
calc = MLIPDDCalculator(LennardJones(epsilon=0.0104, sigma=3.4, cutoff=5.5), nproc=2)
atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(2)
atoms.calc = calc
print("energy", atoms.get_potential_energy())
"""


@pytest.mark.parametrize("how", ["script", "stdin"])
def test_a_program_without_a_main_guard_is_refused_with_the_fix(tmp_path, how):
    """Was broken: blocked forever in process start-up."""
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED)
    command = [sys.executable, str(script)] if how == "script" else [sys.executable, "-"]
    stdin = None if how == "script" else script.open()
    out = subprocess.run(command, stdin=stdin, capture_output=True, text=True, timeout=120, env=program_env(),
                         cwd=tmp_path, check=False)
    assert out.returncode != 0 and "energy" not in out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert 'if __name__ == "__main__":' in last, out.stderr
    assert ("not from a file" in last) == (how == "stdin")


_GUARDED = """
from ase.build import bulk
from mlipdd.ase import MLIPDDCalculator
from mlipdd.models import LennardJones
if __name__ == "__main__":
    calc = MLIPDDCalculator(LennardJones(epsilon=0.0104, sigma=3.4, cutoff=5.5), nproc=2)
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(2)
    atoms.calc = calc
    print("energy", atoms.get_potential_energy())
"""


def test_the_same_program_with_a_main_guard_runs(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(_GUARDED)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=program_env(), check=False)
    assert out.returncode == 0, out.stderr
    assert np.isfinite(float(out.stdout.split()[-1]))


_MODEL_IN_MAIN = """
from mlipdd.ase import MLIPDDCalculator
from mlipdd.models import LennardJones
class MyArgon(LennardJones):
    pass
MLIPDDCalculator(MyArgon(epsilon=0.0104, sigma=3.4, cutoff=5.5), nproc=2)
"""


def test_a_model_class_defined_in_python_c_is_refused_with_the_fix():
    """A notebook's or ``python -c``'s own class cannot reach the ranks (they import it by
    name): refused before any rank starts, naming the class and the fix (was: a rank's
    unpickling traceback, then 'rank 0 died')."""
    out = subprocess.run([sys.executable, "-c", _MODEL_IN_MAIN], capture_output=True, text=True,
                         timeout=120, env=program_env(), check=False)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0 and "MyArgon is defined in a main program that has no file" in last, out.stderr
    assert "define the model class (or factory) in a module" in last
