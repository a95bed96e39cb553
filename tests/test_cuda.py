"""GPU paths (run on a CUDA machine; skipped elsewhere): CUDA tensors through the halo
machinery, NCCL with one rank, several gloo ranks sharing one GPU."""

import pytest
import torch
from mlipdd.models.lj import LennardJones
from mlipdd.testing.conformance import check_conformance
from mlipdd.testing.systems import small_cell, triclinic, two_systems
from mlipdd.testing.toy_models import ToyMPNN

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def lj():
    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=7.0)


def mpnn():
    return ToyMPNN(cutoff=4.5, species=(18,))


@pytest.mark.parametrize("factory", [lj, mpnn], ids=["lj", "mpnn"])
def test_nccl_one_rank_on_cuda(factory):
    check_conformance(factory, triclinic(), 1, device="cuda", backend="nccl").assert_close()


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("make", [triclinic, small_cell, two_systems])
@pytest.mark.parametrize("factory", [lj, mpnn], ids=["lj", "mpnn"])
def test_gloo_ranks_sharing_one_gpu(factory, make, world_size):
    check_conformance(factory, make(), world_size, device="cuda").assert_close()


def test_mace_float64_gloo_ranks_on_gpu():
    import functools

    import mlipdd_mace.testing as mace_testing  # the GPU machine runs every plugin
    factory = functools.partial(mace_testing.random_mace_wrapper, elements=(1, 6, 8), r_max=4.0,
                                dtype=torch.float64, seed=0)
    batch = triclinic(species=(1, 6, 8), spacing=2.5)
    check_conformance(factory, batch, 2, device="cuda").assert_close()


def test_overlap_test_of_a_cuda_batch():
    """The input checks' overlap test on CUDA positions runs on a host copy (vesin's CUDA
    path did not return a 0.01 A list of 1M atoms): same refusal, nothing left on the GPU."""
    from mlipdd.data import InputError, check_no_overlaps

    batch = two_systems().to("cuda")
    check_no_overlaps(batch)
    batch.node["positions"][3] = batch.positions[7]
    with pytest.raises(InputError, match=r"atoms 3 and 7 overlap|atoms 7 and 3 overlap"):
        check_no_overlaps(batch)
