"""cuEquivariance MACE (mace's convert_e3nn_cueq) as a wrapper path, alone and distributed.

On CPU cuequivariance-torch runs its torch reference kernels (``method="naive"``) in
float64, so the same polynomial calls as on the GPU go through `mlipdd_mace.cueq`'s row
rules (counted: a run that never reached them tests nothing); float64 tolerances as the
e3nn suite (measured 1e-15). mace builds its fused convolution only around the CUDA
kernel; `reference_fused_cueq_wrapper` makes the same fused call on the reference kernels,
and the GPU machine runs mace's own (.old/gpu/cueq_dd_check.py).
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

from mlipdd.testing.conformance import gather_by_id, relative_difference
from mlipdd.testing.spawn import run_ranks
from mlipdd_mace.testing import (
    COMPARED_OUTPUTS,
    SMALL_CUEQ_ARCH,
    cueq_mace_wrapper,
    outputs_per_strategy,
    random_mace,
    reference_fused_cueq_wrapper,
    small_cueq_systems,
)
from mlipdd_mace.wrapper import MACEWrapper


@pytest.fixture(scope="module")
def cueq_model():
    return cueq_mace_wrapper(**SMALL_CUEQ_ARCH)


@pytest.fixture(scope="module")
def references(cueq_model):
    """One cuEq process's outputs (with stress) on each small system, unfused and fused: once
    for the module (every distributed check compares with them)."""
    fused = reference_fused_cueq_wrapper(**SMALL_CUEQ_ARCH)
    assert fused.model_config.extra["tensor_products"] == "cuequivariance (fused conv, torch reference kernels)"
    systems = small_cueq_systems()
    return {label: {name: model(b.clone(), compute_stress=True) for name, b in systems.items()}
            for label, model in (("unfused", cueq_model), ("fused", fused))}


def _assert_same(out, ref, tol=1e-10):
    for key in COMPARED_OUTPUTS:
        if key in ref:
            assert relative_difference(out[key].detach(), ref[key].detach()) < tol, key


def test_cueq_equals_e3nn_and_says_so(cueq_model, references):
    e3nn = MACEWrapper(random_mace(**SMALL_CUEQ_ARCH))
    assert cueq_model.model_config.extra["cuequivariance"] is True
    assert cueq_model.model_config.extra["tensor_products"] == "cuequivariance (unfused conv, torch reference kernels)"
    assert "tensor_products='cuequivariance (unfused conv" in repr(cueq_model)
    assert e3nn.model_config.extra["tensor_products"] == "e3nn" and not e3nn.cuequivariance
    for name, batch in small_cueq_systems().items():
        _assert_same(references["unfused"][name], e3nn(batch.clone(), compute_stress=True))
    before = torch.get_default_dtype()
    assert e3nn.to_cueq().cuequivariance and cueq_model.to_cueq() is cueq_model
    assert torch.get_default_dtype() == before, "the converter's default dtype must not leak"


def _unfused_and_fused(rank, world_size, batches, strategies):
    """Spawned-rank worker: both forms of the cuEq model in ONE group of ranks (a launch and
    a cuEq conversion per rank are the slow part on CPU)."""
    return {label: outputs_per_strategy(rank, world_size, functools.partial(build, **SMALL_CUEQ_ARCH), batches,
                                        strategies)
            for label, build in (("unfused", cueq_mace_wrapper), ("fused", reference_fused_cueq_wrapper))}


def test_the_fused_form_is_the_same_model(references):
    for name in references["fused"]:
        _assert_same(references["fused"][name], references["unfused"][name], tol=1e-11)


def test_chunked_cueq_equals_plain_cueq(cueq_model, references):
    batch = small_cueq_systems()["triclinic"]
    ref = references["unfused"]["triclinic"]
    for chunk_atoms in (1, 7):
        _assert_same(MACEWrapper(cueq_model.model, chunk_atoms=chunk_atoms)(batch.clone(), compute_stress=True), ref)
    estimate = MACEWrapper(cueq_model.model, chunk_atoms=1000).memory_estimate(100_000, 4_500_000)
    assert estimate["bytes"] < estimate["plain_bytes"]


def test_chunked_cueq_distributed_equals_plain_cueq(references):
    systems = small_cueq_systems()
    refs = references["unfused"]
    factory = functools.partial(cueq_mace_wrapper, chunk_atoms=3, **SMALL_CUEQ_ARCH)
    parts = run_ranks(outputs_per_strategy, 2, factory, list(systems.values()), ("sharded",), timeout=600)
    for i, (name, batch) in enumerate(systems.items()):
        per_rank = [p["sharded", i] for p in parts]
        forces = gather_by_id(per_rank, "forces", batch.num_atoms)
        assert relative_difference(forces, refs[name]["forces"].detach()) < 1e-10, name
        assert relative_difference(per_rank[0]["stress"], refs[name]["stress"].detach()) < 1e-10, name


def test_from_file_cueq_round_trip(tmp_path, cueq_model):
    batch = small_cueq_systems()["small_cell"]
    ref = cueq_model(batch.clone(), compute_stress=True)
    e3nn_file, cueq_file = tmp_path / "e3nn.model", tmp_path / "cueq.model"
    torch.save(random_mace(**SMALL_CUEQ_ARCH), e3nn_file)
    converted = MACEWrapper.from_file(e3nn_file, cueq=True)
    assert converted.cuequivariance
    _assert_same(converted(batch.clone(), compute_stress=True), ref)
    torch.save(converted.model, cueq_file)
    loaded = MACEWrapper.from_file(cueq_file)  # a converted file stays converted
    assert loaded.model_config.extra["tensor_products"] == converted.model_config.extra["tensor_products"]
    _assert_same(loaded(batch.clone(), compute_stress=True), ref)
    float32 = MACEWrapper.from_file(e3nn_file, dtype=torch.float32, cueq=True)
    assert float32.dtype == torch.float32 and float32.cuequivariance


def test_messages_without_cuequivariance_or_cuda(monkeypatch):
    model = random_mace(**SMALL_CUEQ_ARCH)
    with pytest.raises(ValueError, match="conv_fusion=True needs the model on a CUDA device"):
        MACEWrapper(model, cueq=True, conv_fusion=True)
    with pytest.raises(ValueError, match="pass cueq=True with it"):
        MACEWrapper(model, conv_fusion=False)
    monkeypatch.setitem(sys.modules, "cuequivariance_torch", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"needs cuequivariance-torch.*mlipdd\[cueq\]"):
        MACEWrapper(model, cueq=True)


def test_loading_a_cueq_file_without_cuequivariance(tmp_path, cueq_model):
    path = tmp_path / "cueq.model"
    torch.save(cueq_model.model, path)
    script = (
        "import sys; sys.modules['cuequivariance_torch'] = None; sys.modules['cuequivariance'] = None\n"
        "from mlipdd_mace.wrapper import MACEWrapper\n"
        "try:\n"
        f"    MACEWrapper.from_file({str(path)!r})\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert "holds a cuEquivariance MACE model" in done.stdout and "mlipdd[cueq]" in done.stdout, done.stderr[-2000:]


def test_cli_builds_cueq_mace_and_runs_md(tmp_path):
    """`mlipdd run --model mace --model-arg cueq=true --model-arg chunk_atoms=N --dtype float32`:
    the factory converts on the run's device and dtype; the run's MD takes the model."""
    from ase.io import write

    from mlipdd.app.simulation import RunConfig, build_model
    from mlipdd.cli import main

    e3nn_file = tmp_path / "e3nn.model"
    torch.save(random_mace(**SMALL_CUEQ_ARCH), e3nn_file)
    args = {"path": str(e3nn_file), "cueq": True, "chunk_atoms": 5}
    built = build_model(RunConfig(model="mace", model_args=args, dtype="float32"))
    assert built.cuequivariance and built.dtype == torch.float32 and built.chunk_atoms == 5
    batch = small_cueq_systems()["small_cell"].to(dtype=torch.float32)
    direct = MACEWrapper.from_file(e3nn_file, dtype=torch.float32, cueq=True)
    _assert_same(built(batch.clone()), direct(batch.clone()), tol=1e-5)
    structure = tmp_path / "hco.xyz"
    write(structure, small_cueq_systems()["small_cell"].to_ase()[0])
    assert main(["run", "--model", "mace", "--model-arg", f"path={e3nn_file}", "--model-arg", "cueq=true",
                 "--system", str(structure), "--ensemble", "nve", "--steps", "3", "--dt", "0.2",
                 "--dtype", "float32", "--log-every", "1"]) == 0
