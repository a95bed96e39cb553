"""PMEWrapper(mesh="distributed") (issue 26 item 5): the mesh and its FFT split over ranks.

At 2, 3 and 4 spawned gloo ranks each case equals one process with the whole mesh
(``mesh="replicated"``, ``spline="torch"``: the same B-spline weights) to 1e-12 in float64,
energy, forces and stress: a tilted charged cell so small that ranks see their own images, a
batch of two triclinic cells with random charges, meshes whose planes do not divide by the
rank count (odd sizes, and 3 planes for 4 ranks: a rank holds no plane), a charged slab with
the slab correction cut along its normal, a slab at the bottom of its cell (the upper ranks
own no charge), sharded storage, and float32 (to float32 rounding). A converged case equals
torch-pme's PME at each rank count. One spawned launch per rank count.
"""

from __future__ import annotations

import functools

import pytest
import torch
from mlipdd.testing.pytest_plugin import parse_world_sizes
from mlipdd.testing.spawn import run_ranks
from mlipdd.testing.systems import two_systems
from mlipdd_ewald_pme.testing import (
    compare_distributed,
    configured_cases,
    dipolar_slab,
    offset_slab,
    qeq_pme,
    random_charges,
    rock_salt,
    torchpme_reference,
)
from mlipdd_ewald_pme.wrappers import PMEWrapper

TORCHPME = {"cutoff": 8.0, "accuracy": 1e-8, "mesh_spacing": 0.3}


def pytest_generate_tests(metafunc):
    if "world_size" in metafunc.fixturenames:
        given = metafunc.config.getoption("mlipdd_world_sizes", None)
        metafunc.parametrize("world_size", parse_world_sizes(given) if given else (2, 3, 4))


def _pair(**kwargs):
    """(replicated, distributed) factories: partials of PMEWrapper, so spawned ranks unpickle them"""
    options = {"cutoff": 6.0, "accuracy": 1e-6, **kwargs}
    return (functools.partial(PMEWrapper, mesh="replicated", spline="torch", **options),
            functools.partial(PMEWrapper, mesh="distributed", **options))


def _float32(batch):
    out = batch.clone()
    for key in ("positions", "charges"):
        out.node[key] = out.node[key].float()
    out.system["cell"] = out.system["cell"].float()
    return out


def _cases():
    small = rock_salt((2, 2, 2), vacancies=2, extra_charge=1.0, seed=1)
    tiny = rock_salt((1, 1, 1), extra_charge=0.5, seed=3)  # 8 ions, 5.6 A cell, 6 A cutoff
    pair = random_charges(two_systems(species=(11, 17), spacing=2.9), seed=2, neutral=False)
    cases = [  # (name, replicated factory, distributed factory, batch, DomainConfig options, tolerance)
        ("small triclinic", *_pair(), small, {}, 1e-12),
        ("own images", *_pair(), tiny, {}, 1e-12),
        ("two systems", *_pair(), pair, {}, 1e-12),
        ("mesh 26x26x27", *_pair(mesh_spacing=0.44), small, {}, 1e-12),
        ("3 planes", *_pair(accuracy=0.3, mesh_spacing=1.9, spline_order=3), tiny, {}, 1e-12),
        ("slab correction", *_pair(slab_correction=True), dipolar_slab(12.0, neutral=False), {"grid": "z"}, 1e-12),
        ("rank without charges", *_pair(), offset_slab(30.0), {"grid": "z"}, 1e-12),
        ("sharded", *_pair(), small, {"strategy": "sharded"}, 1e-12),
        ("QEq charges", functools.partial(qeq_pme, "replicated"), qeq_pme, small, {}, 1e-12),
        ("float32", *_pair(), _float32(small), {}, 2e-5),
        ("torch-pme", *_pair(**TORCHPME), small, {}, 1e-12),
    ]
    return cases


@pytest.fixture(scope="module")
def single_process():
    cases = _cases()
    references = [{k: v.detach() for k, v in replicated()(batch, compute_stress=True).items()}
                  for _, replicated, _, batch, _, _ in cases]
    small = cases[-1][3]
    alpha = PMEWrapper(**TORCHPME).alpha
    oracle = torchpme_reference(small, alpha, TORCHPME["cutoff"], "pme", mesh_spacing=0.2, interpolation_nodes=6)
    return cases, references, oracle


def test_one_process_distributed_mesh_equals_replicated(single_process):
    cases, references, _ = single_process
    for (name, _, distributed, batch, _, tolerance), reference in zip(cases, references):
        out = distributed()(batch, compute_stress=True)
        for key in ("energy", "forces", "stress"):
            diff = float((out[key].detach() - reference[key]).abs().max() / reference[key].abs().max())
            assert diff <= tolerance, f"one process, {name}: {key} differs by {diff:.2e}"


def test_distributed_mesh_equals_replicated(single_process, world_size):
    from mlipdd_ewald_pme.distributed_pme import MESH_BYTES

    cases, references, oracle = single_process
    cases[0][2]()(cases[0][3])
    one_rank_bytes = MESH_BYTES["last"]
    runs = [(distributed, batch, True, options) for _, _, distributed, batch, options, _ in cases]
    parts = run_ranks(configured_cases, world_size, runs, timeout=600)
    report = compare_distributed([run[:3] for run in runs], parts, references)
    for (name, _, _, batch, _, tolerance), diffs in zip(cases, report):
        for key in ("energy", "forces", "stress"):
            assert diffs[key] <= tolerance, f"{world_size} ranks, {name}: {key} differs by {diffs[key]:.2e}"
    owned = [p[6]["owned"] for p in parts]
    assert min(owned) == 0 and sum(owned) == cases[6][3].num_atoms, owned  # a rank without charges took part
    # the outside oracle, through the ranks: torch-pme's converged PME
    forces = torch.zeros_like(references[-1]["forces"])
    for part in parts:
        forces[part[-1]["atom_ids"]] = part[-1]["forces"]
    energy = parts[0][-1]["energy"][0]
    assert abs(float(energy - oracle["energy"]) / float(oracle["energy"])) < 1e-7
    assert float((forces - oracle["forces"]).abs().max() / oracle["forces"].abs().max()) < 1e-4
    # mesh memory per rank falls as 1 / ranks: a slab (and order - 1 planes below it), not the mesh
    _, ny, nz = cases[0][2]().mesh_dimensions(cases[0][3].cell)[0]
    largest = max(p[0]["mesh_bytes"] for p in parts)
    assert largest <= 1.1 * one_rank_bytes / world_size + 2 * 6 * ny * nz * 8, (largest, one_rank_bytes)


def test_mesh_options_refused_with_the_fix():
    from mlipdd.data import InputError

    with pytest.raises(InputError, match="mesh must be one of"):
        PMEWrapper(mesh="pencils")
    with pytest.raises(InputError, match="spline='warp' has no distributed form"):
        PMEWrapper(mesh="distributed", spline="warp")
