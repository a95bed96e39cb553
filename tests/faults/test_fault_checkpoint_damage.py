"""Damaged checkpoints and files that are not checkpoints (catalogue entries C7-C9).

C7: torch's zip reader does not check CRCs, so a checkpoint with flipped bits in its
tensor data used to load and run (positions moved, no complaint); a sha256 written with
the checkpoint is verified on load now. C8: random bytes, a trajectory or a text file
given as ``--restart`` used to print torch's four-line ``weights_only`` advice; it is
"not an mlipdd checkpoint", one line naming the file, exit 2. C9: version-1 checkpoints
(before checksums) still load; a version-2 one without its checksum does not.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from fault_helpers import SMALL_RUN, run_here
from mlipdd.app.ensembles import ENSEMBLES
from mlipdd.cli import main
from mlipdd.data import InputError
from mlipdd.distributed import load_checkpoint, save_checkpoint
from mlipdd.distributed.checkpoint import CHECKSUM_KEY, checkpoint_payload
from mlipdd.dynamics import NVE
from mlipdd.lattices import lj_liquid
from mlipdd.models.lj import LennardJones

TINY = ["--size", "2", "--steps", "4", "--log-every", "0", "--progress", "off", "--device", "cpu"]


def _checkpoint(path: Path) -> Path:
    batch = lj_liquid(2, temperature=100.0, seed=1)
    dyn = NVE(LennardJones(epsilon=0.0104, sigma=3.4, cutoff=5.5), 2.0)
    dyn.run(batch, 2)
    return save_checkpoint(path, batch, dyn)


def _flip_a_bit(path: Path, bit: int) -> None:
    """Flip one bit inside the largest tensor record of the zip archive, as a bad disk
    sector or a damaged copy would (the archive stays readable: torch checks no CRC)."""
    with zipfile.ZipFile(path) as archive:
        record = max(
            (info for info in archive.infolist() if "/data/" in info.filename),
            key=lambda info: info.file_size,
        )
    raw = bytearray(path.read_bytes())
    name_length = int.from_bytes(
        raw[record.header_offset + 26 : record.header_offset + 28], "little"
    )
    extra_length = int.from_bytes(
        raw[record.header_offset + 28 : record.header_offset + 30], "little"
    )
    start = record.header_offset + 30 + name_length + extra_length
    raw[start + record.file_size // 2 + bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(raw))


def _restart_error(capsys, path: Path) -> str:
    assert main(["run", *TINY, "--restart", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    assert str(path) in err
    return err


# ---- C7: flipped bits are caught by the checksum ---------------------------------------------


@pytest.mark.parametrize("bit", [0, 62], ids=["lowest-mantissa-bit", "exponent-bit"])
def test_flipped_bits_in_tensor_data_are_refused(bit, tmp_path, capsys):
    path = _checkpoint(tmp_path / "state.pt")
    assert load_checkpoint(path).step == 2
    _flip_a_bit(path, bit)
    torch.load(path, weights_only=True)  # torch itself reads the damaged file without a word
    with pytest.raises(InputError, match="is damaged.*do not match the sha256") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert "older checkpoint" in _restart_error(capsys, path)


def test_a_changed_value_with_a_stale_checksum_is_refused(tmp_path):
    path = _checkpoint(tmp_path / "state.pt")
    data = torch.load(path, weights_only=True)
    data["node"]["positions"][3, 1] += 0.016
    torch.save(data, path)
    with pytest.raises(InputError, match="do not match the sha256"):
        load_checkpoint(path)
    data = torch.load(path, weights_only=True)
    data["dynamics_state"]["step_count"] = 7
    data["node"]["positions"][3, 1] -= 0.016
    torch.save(data, path)
    with pytest.raises(InputError, match="do not match the sha256"):
        load_checkpoint(path)


def test_a_truncated_checkpoint_is_named_damaged(tmp_path, capsys):
    path = _checkpoint(tmp_path / "state.pt")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert "is damaged" in _restart_error(capsys, path)


@pytest.mark.parametrize("ensemble", sorted(ENSEMBLES))
def test_every_ensembles_checkpoint_verifies_and_restarts(ensemble, tmp_path, capsys):
    """The checksum is stable through save and load for every integrator's state."""
    path = tmp_path / f"{ensemble}.pt"
    flags = ["--ensemble", ensemble, "--checkpoint", str(path)]
    assert main(["run", *TINY, *flags]) == 0
    data = torch.load(path, weights_only=True)
    assert len(data[CHECKSUM_KEY]["sha256"]) == 64 and data["version"] == 2
    assert load_checkpoint(path).step == int(data["dynamics_state"]["step_count"]) >= 1
    capsys.readouterr()
    assert main(["run", *TINY, "--ensemble", ensemble, "--restart", str(path)]) == 0


# ---- C8: what is not a checkpoint says so, in one line ---------------------------------------


def _random_bytes(path: Path) -> None:
    path.write_bytes(
        torch.randint(
            0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
        )
        .numpy()
        .tobytes()
    )


def _trajectory(path: Path) -> None:
    import ase.io
    from ase.build import bulk

    ase.io.write(path, bulk("Ar", "fcc", a=5.26, cubic=True))


def _extxyz(path: Path) -> None:
    import ase.io
    from ase.build import bulk

    ase.io.write(path, bulk("Ar", "fcc", a=5.26, cubic=True), format="extxyz")


@pytest.mark.parametrize(
    "name, write, what",
    [
        ("junk.bin", _random_bytes, "not a torch.save archive"),
        ("md.traj", _trajectory, "an ASE trajectory"),
        ("md.extxyz", _extxyz, "a text file"),
        ("empty.pt", lambda path: path.write_bytes(b""), "an empty file"),
    ],
    ids=["random-bytes", "ase-trajectory", "extxyz", "empty"],
)
def test_a_file_that_is_not_a_checkpoint_says_so_in_one_line(name, write, what, tmp_path, capsys):
    path = tmp_path / name
    write(path)
    with pytest.raises(InputError, match="is not an mlipdd checkpoint") as info:
        load_checkpoint(path)
    assert what in str(info.value) and "\n" not in str(info.value)
    err = _restart_error(capsys, path)
    assert "is not an mlipdd checkpoint" in err and "weights_only" not in err


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_torch_archive_holding_python_objects_is_not_unpickled(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "state.pt"
    torch.save({"format": "mlipdd-checkpoint", "x": _Exploit(marker)}, path)
    err = _restart_error(capsys, path)
    assert "is not an mlipdd checkpoint" in err and "nothing in it ran" in err
    assert "weights_only" not in err and not marker.exists()


# ---- C9: versions -----------------------------------------------------------------------------


def test_a_version_1_checkpoint_without_checksum_still_loads(tmp_path):
    batch = lj_liquid(2, temperature=100.0, seed=1)
    dyn = NVE(LennardJones(epsilon=0.0104, sigma=3.4, cutoff=5.5), 2.0)
    payload = {**checkpoint_payload(batch, dyn), "version": 1}
    torch.save(payload, tmp_path / "old.pt")  # as mlipdd wrote it before checksums
    assert torch.equal(load_checkpoint(tmp_path / "old.pt").batch.positions, batch.positions)


def test_a_version_2_checkpoint_without_its_checksum_is_refused(tmp_path):
    path = _checkpoint(tmp_path / "state.pt")
    data = torch.load(path, weights_only=True)
    del data[CHECKSUM_KEY]
    torch.save(data, path)
    with pytest.raises(InputError, match="lacks the checksum"):
        load_checkpoint(path)


# ---- the same through a launched 2-rank run ---------------------------------------------------


@pytest.mark.parametrize("damage", ["flipped-bit", "random-bytes"])
def test_two_ranks_refuse_a_damaged_restart_in_one_line(damage, tmp_path, capfd):
    path = tmp_path / "state.pt"
    if damage == "flipped-bit":
        _flip_a_bit(_checkpoint(path), 62)
    else:
        _random_bytes(path)
    code, err = run_here(capfd, tmp_path, *SMALL_RUN, "--nproc", "2", "--steps", "2", "--restart", str(path))
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], lines
    assert ("is damaged" if damage == "flipped-bit" else "is not an mlipdd checkpoint") in lines[0]
