"""Bad inputs get one clear error naming the fix (catalogue entries I1-I3).

I1: an empty system (0 atoms) used to die in ZeroDivisionError (one process) or in
``max()`` of an empty tensor (two ranks). I2: a checkpoint that is a malicious pickle is
refused without running it.
"""

from __future__ import annotations

import pickle

import ase
import ase.io
import pytest
from mlipdd.data import Batch, InputError
from mlipdd.distributed import DomainConfig, DomainParallel, load_checkpoint
from mlipdd.dynamics import NVE
from mlipdd.lattices import lj_liquid
from mlipdd.models.lj import LennardJones
from mlipdd.testing import RankFailure, run_ranks

NO_ATOMS = "has no atoms; give a structure with at least one atom"


def _lj():
    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=5.5)


def test_empty_structure_file_in_one_process(tmp_path, capsys):
    from mlipdd.cli import main

    path = tmp_path / "empty.xyz"
    ase.io.write(path, ase.Atoms(cell=[10, 10, 10], pbc=True), format="extxyz")
    flags = ["--steps", "3", "--device", "cpu", "--progress", "off", "--log-every", "0"]
    assert main(["run", "--system", str(path), *flags]) == 2
    assert NO_ATOMS in capsys.readouterr().err


def test_an_empty_system_in_a_batch_is_named():
    full = lj_liquid(2, temperature=100.0, seed=1)
    empty = Batch.from_ase(ase.Atoms(cell=[10, 10, 10], pbc=True))
    empty.velocities = full.velocities[:0]
    batch = Batch.from_data_list([full, empty])
    with pytest.raises(InputError, match=r"systems \[1\] have no atoms"):
        NVE(_lj(), 2.0).run(batch, 1)


def _partition_empty(rank, world_size):
    empty = Batch.from_ase(ase.Atoms(cell=[10, 10, 10], pbc=True))
    with DomainParallel(NVE(_lj(), 2.0), DomainConfig(cutoff=5.5), 3) as dp:
        dp.partition(empty if rank == 0 else None)
        dp.run()


def test_empty_system_under_dd_is_the_same_error_on_every_rank():
    with pytest.raises(RankFailure) as info:
        run_ranks(_partition_empty, 2, timeout=120)
    for text in info.value.failures.values():
        last = text.strip().splitlines()[-1]
        assert NO_ATOMS in last and "InputError" in last, last


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_pickle_as_checkpoint_is_refused_unrun(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "state.pt"
    path.write_bytes(
        pickle.dumps({"format": "mlipdd-checkpoint", "x": _Exploit(marker)}, protocol=2)
    )
    with pytest.raises(InputError, match="cannot be read"):
        load_checkpoint(path)
    assert not marker.exists()
