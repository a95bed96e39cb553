"""Neighbour lists against a brute-force all-images search, and the rebuild policy."""

import itertools

import numpy as np
import pytest
import torch
from mlipdd.data import AtomicData, Batch, InputError
from mlipdd.neighbors import NeighborListPolicy, attach_neighbors, build_neighbor_list


def brute_force_edges(positions, cell, pbc, cutoff, offset=0, extra_images=0):
    """Every (i, j, shift) with |pos[j] + shift @ cell - pos[i]| < cutoff, images included.

    Shifts range far enough along each periodic axis: the plane spacing of axis k is
    volume / |a_l x a_m|, so ceil(cutoff / spacing) + 1 images cover atoms anywhere
    inside the cell.
    """
    pos = np.asarray(positions, dtype=np.float64)
    cell = np.asarray(cell, dtype=np.float64)
    # a zero vector along a non-periodic axis only matters for the spacing: stand in a normal
    spanning = cell.copy()
    for k in range(3):
        if not pbc[k] and np.linalg.norm(spanning[k]) == 0:
            normal = np.cross(spanning[(k + 1) % 3], spanning[(k + 2) % 3])
            spanning[k] = normal if np.linalg.norm(normal) > 0 else np.eye(3)[k]
    ranges = []
    for k in range(3):
        if not pbc[k]:
            ranges.append([0])
            continue
        other = spanning[[(k + 1) % 3, (k + 2) % 3]]
        spacing = abs(np.linalg.det(spanning)) / np.linalg.norm(np.cross(other[0], other[1]))
        n = int(np.ceil(cutoff / spacing)) + 1 + extra_images
        ranges.append(range(-n, n + 1))
    edges = set()
    for shift in itertools.product(*ranges):
        vec = pos[None, :, :] + np.asarray(shift, dtype=np.float64) @ cell - pos[:, None, :]
        dist = np.linalg.norm(vec, axis=-1)  # [i, j]
        for i, j in zip(*np.nonzero(dist < cutoff)):
            if i == j and shift == (0, 0, 0):
                continue
            edges.add((int(i) + offset, int(j) + offset, shift))
    return edges


def as_edge_set(neighbors):
    ei = neighbors.edge_index.tolist()
    shifts = neighbors.unit_shifts.tolist()
    for s in shifts:  # the stored shifts must be integers
        assert all(float(x).is_integer() for x in s)
    out = {(i, j, tuple(int(x) for x in s)) for i, j, s in zip(ei[0], ei[1], shifts)}
    assert len(out) == neighbors.num_edges, "duplicate edges"
    return out


def random_system(rng, n, cell, pbc):
    cell = np.asarray(cell, dtype=np.float64)
    frac = rng.random((n, 3))
    return AtomicData(frac @ cell, rng.integers(1, 10, n), cell=cell, pbc=pbc, dtype=torch.float64)


def check_against_brute_force(batch, cutoff, extra_images=0):
    neighbors = build_neighbor_list(batch, cutoff)
    expected = set()
    for s, system in enumerate(batch.to_data_list()):
        expected |= brute_force_edges(
            system.positions,
            system.cell[0],
            system.pbc[0].tolist(),
            cutoff,
            int(batch.ptr[s]),
            extra_images,
        )
    assert as_edge_set(neighbors) == expected
    # edge vectors from the cartesian shifts equal the brute-force geometry
    vec = neighbors.edge_vectors(batch.positions, batch.cell, batch.batch)
    assert bool((vec.norm(dim=1) < cutoff).all())
    return neighbors


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_triclinic_periodic(seed):
    rng = np.random.default_rng(seed)
    cell = np.diag(rng.uniform(6.0, 8.0, 3)) + rng.uniform(-1.5, 1.5, (3, 3)) * (1 - np.eye(3))
    data = random_system(rng, 40, cell, True)
    neighbors = check_against_brute_force(data, cutoff=3.0)
    assert neighbors.num_edges > 0


def test_cell_thinner_than_twice_cutoff():
    rng = np.random.default_rng(3)
    cell = np.array([[7.0, 0.0, 0.0], [0.8, 6.5, 0.0], [0.4, -0.6, 2.2]])  # c spacing 2.2 < 2 * 3.0
    data = random_system(rng, 12, cell, True)
    neighbors = check_against_brute_force(data, cutoff=3.0)
    # an atom sees images of itself
    assert bool((neighbors.edge_index[0] == neighbors.edge_index[1]).any())


def test_tiny_cell_many_images():
    data = random_system(np.random.default_rng(4), 2, np.eye(3) * 1.5 + 0.2, True)
    check_against_brute_force(data, cutoff=3.5)


def test_atoms_outside_the_periodic_cell():
    """Unwrapped MD coordinates: atoms up to two cells away from the box."""
    rng = np.random.default_rng(15)
    cell = np.array([[5.5, 0.0, 0.0], [1.0, 6.0, 0.0], [-0.5, 0.7, 5.0]])
    frac = rng.uniform(-2.0, 3.0, (25, 3))
    data = AtomicData(frac @ cell, np.ones(25, int), cell=cell, pbc=True)
    check_against_brute_force(data, cutoff=3.0, extra_images=3)


def test_slab_non_periodic_z():
    rng = np.random.default_rng(5)
    cell = np.array([[6.0, 0.0, 0.0], [1.5, 5.5, 0.0], [0.3, 0.2, 9.0]])
    data = random_system(rng, 40, cell, [True, True, False])
    check_against_brute_force(data, cutoff=3.0)


def test_slab_with_zero_vector_and_atoms_outside_box():
    rng = np.random.default_rng(6)
    cell = np.array([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 0.0]])
    pos = rng.random((30, 3)) * np.array([5.0, 5.0, 1.0]) + np.array([0.0, 0.0, -6.0])
    pos[:, 2] *= rng.uniform(0.5, 2.0, 30)  # z spread well beyond the (absent) c vector
    data = AtomicData(pos, np.ones(30, int), cell=cell, pbc=[True, True, False])
    check_against_brute_force(data, cutoff=3.0)


def test_mixed_pbc_single_periodic_axis():
    rng = np.random.default_rng(7)
    cell = np.array([[4.0, 0.5, 0.0], [0.0, 8.0, 0.0], [0.0, 1.0, 8.0]])
    data = random_system(rng, 30, cell, [True, False, False])
    check_against_brute_force(data, cutoff=3.2)


def test_open_cluster_zero_cell():
    rng = np.random.default_rng(8)
    data = AtomicData(rng.random((35, 3)) * 7.0 - 20.0, np.ones(35, int))  # no cell, pbc False
    assert not bool(data.pbc.any())
    neighbors = check_against_brute_force(data, cutoff=2.5)
    assert bool((neighbors.unit_shifts == 0).all())


def test_batch_of_two_different_systems_and_ordering():
    rng = np.random.default_rng(9)
    periodic = random_system(rng, 25, np.diag([5.0, 6.0, 5.5]) + 0.4 * (1 - np.eye(3)), True)
    slab = random_system(
        rng, 18, np.array([[5.0, 0, 0], [0, 5.0, 0], [0, 0, 10.0]]), [True, True, False]
    )
    batch = Batch.from_data_list([periodic, slab])
    neighbors = check_against_brute_force(batch, cutoff=2.8)
    # no edge joins two systems
    sys_of = batch.batch
    assert torch.equal(sys_of[neighbors.edge_index[0]], sys_of[neighbors.edge_index[1]])
    # sorted by receiver, then sender, then shift: lexicographic order of the rows
    rows = list(
        zip(
            neighbors.edge_index[1].tolist(),
            neighbors.edge_index[0].tolist(),
            neighbors.unit_shifts.tolist(),
        )
    )
    assert rows == sorted(rows)
    # the same list comes out of a batch whose second system comes first (indices remapped)
    swapped = build_neighbor_list(Batch.from_data_list([slab, periodic]), cutoff=2.8)
    n0, n1 = periodic.num_atoms, slab.num_atoms
    remap = torch.cat([torch.arange(n1, n1 + n0), torch.arange(n1)])  # old row -> new row
    old = {(int(remap[i]), int(remap[j]), s) for i, j, s in as_edge_set(neighbors)}
    assert old == as_edge_set(swapped)


def test_half_list_holds_each_pair_once():
    data = random_system(np.random.default_rng(10), 30, np.eye(3) * 6.0, True)
    full = as_edge_set(build_neighbor_list(data, 3.0))
    half = as_edge_set(build_neighbor_list(data, 3.0, full_list=False))
    mirrored = {(j, i, tuple(-x for x in s)) for i, j, s in half}
    assert half | mirrored == full
    assert len(half) * 2 == len(full)


def test_shifts_differentiable_in_cell():
    data = random_system(np.random.default_rng(11), 10, np.eye(3) * 3.0, True)
    neighbors = build_neighbor_list(data, 2.5)
    cell = data.cell.clone().requires_grad_(True)
    shifts = neighbors.shifts(cell, data.batch)
    (grad,) = torch.autograd.grad(shifts.sum(), cell)
    # d(sum_e sum_b n_e,a * cell_ab) / d cell_ab = sum_e n_e,a
    expected = neighbors.unit_shifts.sum(0).view(3, 1).expand(3, 3)
    assert torch.equal(grad[0], expected)
    assert neighbors.unit_shifts.dtype == data.positions.dtype


def test_periodic_axis_with_zero_vector_is_rejected():
    data = AtomicData(
        np.zeros((2, 3)) + [[0, 0, 0], [1, 0, 0]], [1, 1], cell=np.diag([5.0, 5.0, 0.0]), pbc=True
    )
    with pytest.raises(InputError, match="axis c is periodic"):
        build_neighbor_list(data, 2.0)


def test_attach_records_reference_geometry():
    data = random_system(np.random.default_rng(12), 10, np.eye(3) * 5.0, True)
    neighbors = attach_neighbors(data, 2.0)
    assert data.neighbors is neighbors
    assert torch.equal(neighbors.reference_positions, data.positions)
    assert torch.equal(neighbors.reference_cell, data.cell)
    assert neighbors.cutoff == 2.0


def test_policy_rebuild_rule():
    rng = np.random.default_rng(13)
    data = random_system(rng, 20, np.eye(3) * 6.0, True)
    policy = NeighborListPolicy(cutoff=2.5, skin=0.4)
    assert policy.needs_rebuild(data)  # never built
    neighbors = policy.build(data)
    assert neighbors.cutoff == pytest.approx(2.9) and data.neighbors is neighbors
    assert not policy.needs_rebuild(data)

    moved = data.clone()
    moved.positions[3] += torch.tensor([0.0, 0.19, 0.0], dtype=torch.float64)  # < skin / 2
    assert not policy.needs_rebuild(moved)
    moved.positions[3] += torch.tensor([0.0, 0.02, 0.0], dtype=torch.float64)  # now 0.21 > 0.2
    assert policy.needs_rebuild(moved)

    # a changed cell keeps the list while the strain bound holds (NOTE [skin under strain])
    strained = data.clone()
    strained.cell = strained.cell * 1.001
    assert not policy.needs_rebuild(strained)
    strained.cell = data.cell * 0.85  # periodic images 15 % closer: 2.5 / 0.85 > 2.9
    assert policy.needs_rebuild(strained)

    reordered = data.clone()
    reordered.atom_ids = reordered.atom_ids.flip(0)
    assert policy.needs_rebuild(reordered)

    fewer = data.select_atoms(torch.arange(19))
    assert policy.needs_rebuild(fewer)


def test_list_built_with_skin_stays_valid_within_half_skin():
    """The whole point of the rule: after moves <= skin/2 every pair within cutoff is listed."""
    rng = np.random.default_rng(14)
    data = random_system(rng, 40, np.eye(3) * 6.5, True)
    cutoff, skin = 2.5, 0.6
    policy = NeighborListPolicy(cutoff, skin)
    stale = policy.build(data)
    moved = data.clone()
    step = torch.as_tensor(rng.normal(size=(40, 3)))
    moved.positions += 0.299 * step / step.norm(dim=1, keepdim=True)
    assert not policy.needs_rebuild(moved)
    vec = stale.edge_vectors(moved.positions, moved.cell, moved.batch)
    kept = stale.select(vec.norm(dim=1) < cutoff)
    assert as_edge_set(kept) == as_edge_set(build_neighbor_list(moved, cutoff))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "cell, pbc, n, cutoff",
    [
        (np.array([[6.0, 0.0, 0.0], [1.2, 6.5, 0.0], [-0.7, 0.4, 5.8]]), True, 60, 3.0),
        (np.array([[7.0, 0.0, 0.0], [0.8, 6.5, 0.0], [0.4, -0.6, 2.2]]), True, 12, 3.0),
        (
            np.array([[6.0, 0.0, 0.0], [1.5, 5.5, 0.0], [0.0, 0.0, 0.0]]),
            [True, True, False],
            40,
            3.0,
        ),
        (np.zeros((3, 3)), False, 40, 2.5),
    ],
    ids=["triclinic", "thin", "slab", "open"],
)
def test_cuda_list_equals_brute_force(cell, pbc, n, cutoff):
    rng = np.random.default_rng(16)
    extent = np.where(np.linalg.norm(cell, axis=1) > 0, 1.0, 0.0)[:, None] * cell + np.diag(
        np.where(np.linalg.norm(cell, axis=1) > 0, 0.0, 7.0)
    )
    data = AtomicData(rng.random((n, 3)) @ extent, np.ones(n, int), cell=cell, pbc=pbc)
    cuda = data.to("cuda")
    neighbors = build_neighbor_list(cuda, cutoff)
    assert neighbors.edge_index.device.type == "cuda"
    assert neighbors.unit_shifts.device.type == "cuda"
    assert as_edge_set(neighbors) == brute_force_edges(
        data.positions, cell, data.pbc[0].tolist(), cutoff
    )
    cpu = build_neighbor_list(data, cutoff)
    assert torch.equal(neighbors.edge_index.cpu(), cpu.edge_index)  # same deterministic order


def test_batch_with_interleaved_system_rows():
    rng = np.random.default_rng(17)
    first = random_system(rng, 14, np.eye(3) * 5.0 + 0.3 * (1 - np.eye(3)), True)
    second = random_system(rng, 11, np.diag([4.5, 6.0, 9.0]), [True, False, True])
    batch = Batch.from_data_list([first, second])
    perm = torch.as_tensor(rng.permutation(batch.num_atoms))
    shuffled = batch.select_atoms(perm)  # rows of the two systems interleave
    assert not bool((shuffled.batch.diff() >= 0).all())
    edges = as_edge_set(build_neighbor_list(shuffled, 2.9))
    new_row_of = torch.argsort(perm)  # old row -> new row
    expected = {
        (int(new_row_of[i]), int(new_row_of[j]), s)
        for i, j, s in as_edge_set(build_neighbor_list(batch, 2.9))
    }
    assert edges == expected
