"""Bad input and failing ranks: the same clear error on every rank, promptly, never a hang."""

import functools
import time

import pytest
import torch
from mlipdd.data import InputError
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.testing import RankFailure, run_ranks
from mlipdd.testing.conformance import check_conformance
from mlipdd.testing.systems import cubic, slab
from mlipdd.testing.toy_models import ToyMPNN


def _model(**kw):
    return ToyMPNN(cutoff=4.5, species=(18,), **kw)


def _forward(rank, world_size, batch, poison_rank=None, raise_rank=None, drop_rebind=False, cutoff=None):
    model = _model(drop_rebind=drop_rebind)
    dm = DistributedModel(model, DomainConfig(cutoff=cutoff or model.cutoff))
    owned = dm.partition(batch if rank == 0 else None)
    if poison_rank == rank and owned.num_atoms:
        owned.positions[0, 1] = float("nan")
    if raise_rank is not None:
        original = model.atomic_energies

        def failing(*args, **kwargs):
            if rank == raise_rank:
                raise RuntimeError("boom from the model on one rank")
            return original(*args, **kwargs)

        model.atomic_energies = failing
    dm(owned)
    return "finished"


def _messages(exc: RankFailure) -> dict:
    return exc.failures


def test_nan_positions_on_one_rank_raise_everywhere():
    with pytest.raises(RankFailure) as info:
        run_ranks(_forward, 3, cubic(), poison_rank=1, timeout=60)
    msgs = _messages(info.value)
    assert sorted(msgs) == [0, 1, 2]
    assert all("NaN" in m and "DistributedInputError" in m or "InputError" in m for m in msgs.values())


def test_bad_full_system_is_reported_on_every_rank():
    batch = cubic()
    batch.positions[5, 0] = float("inf")
    with pytest.raises(RankFailure) as info:
        run_ranks(_forward, 2, batch, timeout=60)
    assert sorted(info.value.failures) == [0, 1]
    assert all("NaN or inf" in m for m in info.value.failures.values())


def test_atoms_outside_non_periodic_box():
    batch = slab()
    batch.positions[3, 2] = -5.0
    with pytest.raises(RankFailure) as info:
        run_ranks(_forward, 2, batch, timeout=60)
    assert all("outside the box" in m and "vacuum" in m for m in info.value.failures.values())


def test_a_rank_that_raises_stops_every_rank_promptly():
    start = time.time()
    with pytest.raises(RankFailure) as info:
        run_ranks(_forward, 3, cubic(), raise_rank=1, timeout=60)
    elapsed = time.time() - start
    failures = info.value.failures
    assert sorted(failures) == [0, 1, 2]
    assert all("boom from the model on one rank" in m for m in failures.values()), failures
    assert elapsed < 30, f"ranks took {elapsed:.1f} s to stop"


def test_dropped_inplace_scatter_return_is_exact_under_aten():
    # the aten dispatch keeps in-place ops in place: `x.index_add_(...)` called for its side
    # effect updates x itself, on every rank, as in one process
    result = check_conformance(functools.partial(_model, drop_rebind=True), cubic(), 2, compute_stress=False,
                               config_kwargs={})
    assert result.rel_diff["energy"] < 1e-10 and result.rel_diff["forces"] < 1e-10, result.rel_diff


def test_domain_cutoff_below_model_cutoff_is_refused():
    with pytest.raises(InputError, match="smaller than the model's cutoff"):
        DistributedModel(_model(), DomainConfig(cutoff=3.0))


def test_single_process_drop_rebind_still_works():
    """The mistake is invisible single-process; only distribution exposes it."""
    batch = cubic()
    out = _model(drop_rebind=True)(batch)
    ref = _model()(batch)
    assert torch.allclose(out["energy"], ref["energy"])
