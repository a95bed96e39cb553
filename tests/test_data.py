"""AtomicData / Batch: batching, ASE round trips, files, and a clear error for each bad input."""

import numpy as np
import pytest
import torch
from ase.build import bulk, molecule
from mlipdd.data import AtomicData, Batch, InputError, check_inside_box


def argon():
    return bulk("Ar", "fcc", 5.26, cubic=True) * 2


def test_batch_of_systems_keeps_layout_and_ids():
    water = molecule("H2O")
    water.center(vacuum=4.0)
    batch = Batch.from_ase([argon(), water])
    assert batch.num_systems == 2 and batch.num_atoms == 35
    assert batch.ptr.tolist() == [0, 32, 35]
    assert torch.equal(batch.atom_ids, torch.arange(35))
    assert torch.equal(batch.batch, torch.tensor([0] * 32 + [1] * 3))
    assert batch.cell.shape == (2, 3, 3) and batch.pbc.shape == (2, 3)
    first, second = batch.to_data_list()
    assert first.num_atoms == 32 and second.num_atoms == 3


def test_ase_round_trip_with_velocities_charge_and_masses():
    atoms = argon()
    atoms.set_velocities(np.random.default_rng(0).normal(size=(len(atoms), 3)) * 0.01)
    atoms.info["charge"] = 1.0
    data = AtomicData.from_ase(atoms)
    back = data.to_ase()
    assert np.allclose(back.positions, atoms.positions) and np.allclose(back.cell, atoms.cell)
    assert np.allclose(back.get_velocities(), atoms.get_velocities())
    assert np.allclose(back.get_masses(), atoms.get_masses())
    assert float(data.charge[0]) == 1.0


def test_default_masses_by_element_and_float64_default():
    data = AtomicData(positions=[[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], atomic_numbers=[1, 8])
    assert data.dtype == torch.float64
    assert torch.allclose(data.atomic_masses, torch.tensor([1.008, 15.999], dtype=torch.float64), atol=1e-3)


def test_any_file_ase_reads(tmp_path):
    path = tmp_path / "frames.extxyz"
    import ase.io

    ase.io.write(path, [argon(), argon()])
    batch = Batch.read(path)
    assert batch.num_systems == 2 and batch.num_atoms == 64


def test_add_node_property_travels_with_atoms():
    batch = Batch.from_ase(argon())
    batch.add_node_property("velocities", torch.ones(batch.num_atoms, 3, dtype=torch.float64))
    picked = batch.select_atoms(torch.tensor([3, 5]))
    assert picked.velocities.shape == (2, 3) and picked.atom_ids.tolist() == [3, 5]
    with pytest.raises(InputError, match="one row per atom"):
        batch.add_node_property("charges", torch.zeros(3))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b.node.__setitem__("positions", b.positions[:, :2]), "shape \\(n_atoms, 3\\)"),
        (lambda b: b.positions.__setitem__((0, 0), float("nan")), "NaN or inf"),
        (lambda b: b.positions.__setitem__((1, 2), float("inf")), "NaN or inf"),
        (lambda b: b.atomic_numbers.__setitem__(0, 0), "unknown element"),
        (lambda b: b.atomic_numbers.__setitem__(0, 200), "unknown element"),
        (lambda b: b.system.__setitem__("cell", torch.zeros(1, 3, 3, dtype=torch.float64)), "singular"),
        (lambda b: b.atomic_masses.__setitem__(0, -1.0), "masses must be positive"),
    ],
    ids=["shape", "nan", "inf", "element-0", "element-200", "singular-cell", "mass"],
)
def test_bad_input_is_named_with_the_fix(mutate, message):
    batch = Batch.from_ase(argon())
    mutate(batch)
    with pytest.raises(InputError, match=message):
        batch.validate()


def test_missing_velocities_names_the_fix():
    with pytest.raises(InputError, match="add_node_property"):
        Batch.from_ase(argon()).validate(require=("velocities",))


def test_atoms_outside_a_non_periodic_box():
    slab = argon()
    slab.pbc = (True, True, False)
    slab.positions[0, 2] = -3.0
    with pytest.raises(InputError, match="outside the box along non-periodic axis z"):
        check_inside_box(Batch.from_ase(slab))


def test_unknown_element_in_constructor():
    with pytest.raises(InputError, match="unknown element"):
        AtomicData(positions=[[0.0, 0.0, 0.0]], atomic_numbers=[130])


def test_overlap_test_on_host_geometry_names_the_atoms():
    """CUDA batches are checked on a CPU copy of their geometry (`_host_geometry`): the
    copy keeps each system's rows, cell and atom ids, so the same pair is named, images too."""
    from mlipdd.data import _host_geometry, check_no_overlaps
    from mlipdd.testing.systems import two_systems

    batch = two_systems()
    second = torch.nonzero(batch.batch == 1).flatten()
    a, b = int(second[1]), int(second[4])
    batch.node["positions"][b] = batch.positions[a] + batch.cell[1][0]  # b sits on a's image
    host = _host_geometry(batch)
    assert host.positions.device.type == "cpu" and host.num_systems == 2
    with pytest.raises(InputError, match=rf"atoms {a} and {b} \(a periodic image\) overlap|atoms {b} and {a} \(a periodic image\) overlap"):
        check_no_overlaps(host)


def test_overlap_test_cuts_its_search_list_to_the_overlap_distance():
    """The list is searched wider than the overlap distance (NOTE [overlap search radius] in
    mlipdd.data): bonds inside that radius are no overlap, and only the real overlaps are
    named and counted, in a slab with vacuum (the case the wide search is for)."""
    from mlipdd.data import OVERLAP_DISTANCE, OVERLAP_SEARCH_RADIUS, check_no_overlaps

    water = molecule("H2O")  # O-H 0.97 A: inside the search radius, far from an overlap
    water.cell, water.pbc = [8.0, 8.0, 20.0], (True, True, False)
    water.center()
    bonds = float(np.linalg.norm(water.positions[0] - water.positions[1]))
    assert OVERLAP_DISTANCE < bonds < OVERLAP_SEARCH_RADIUS
    check_no_overlaps(Batch.from_ase(water))
    doubled = water + water[1:]  # both hydrogens placed twice, 0.005 A off
    doubled.positions[3:] += 0.005
    with pytest.raises(InputError, match=r"atoms 1 and 3 overlap: 0.00866 A apart.*; 2 such pairs in all"):
        check_no_overlaps(Batch.from_ase(doubled))
