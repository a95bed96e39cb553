"""Graph partition equals one process: a model that builds its own graph, 1-4 real gloo ranks, float64."""

import pytest
import torch
from mlipdd.data import Batch, InputError
from mlipdd.distributed import DistributedModel, DomainConfig
from mlipdd.distributed.config import StrategyKind
from mlipdd.shard import graph_partition as gp
from mlipdd.spec.presets import SPEC_MPNN_GP, SPEC_MPNN_HALO
from mlipdd.testing import RankFailure, run_ranks
from mlipdd.testing.conformance import check_conformance
from mlipdd.testing.graph_building_model import GraphBuildingMPNN
from mlipdd.testing.systems import _grid_system, slab, small_cell, triclinic, two_systems
from mlipdd.testing.toy_models import ToyMPNN

GP = {"strategy": StrategyKind.GRAPH_PARTITION}


def graph_model():
    return GraphBuildingMPNN(cutoff=4.5, layers=3, species=(18, 8))


def toy_model():
    return ToyMPNN(cutoff=4.5, layers=2, species=(18, 8))


def _triclinic():
    return triclinic(species=(18, 8), reps=4)


def _two_systems():
    return two_systems(species=(18, 8))


SYSTEMS = {"triclinic": _triclinic, "two_systems": _two_systems, "small_cell": small_cell, "slab": slab}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("system", ["triclinic", "two_systems"])
def test_graph_partition_equals_single_process(system, world_size):
    result = check_conformance(graph_model, SYSTEMS[system](), world_size, config_kwargs=GP)
    result.assert_close(energy=1e-12, forces=1e-10, stress=1e-10)
    assert float(result.reference["forces"].abs().max()) > 1e-3  # a real test, not zeros


@pytest.mark.parametrize("system", ["small_cell", "slab"])
def test_own_images_and_vacuum(system):
    check_conformance(graph_model, SYSTEMS[system](), 3, config_kwargs=GP).assert_close()


def test_more_ranks_than_atoms():
    """A rank that owns nothing still joins every collective (empty blocks)."""
    cell = torch.eye(3, dtype=torch.float64) * 5.0
    batch = Batch.from_data_list([_grid_system(cell, True, (3, 1, 1), (18,), 7)])
    check_conformance(graph_model, batch, 4, config_kwargs=GP).assert_close()


# ---- the partition and the helpers ---------------------------------------------------------


@pytest.mark.parametrize("n, world_size", [(10, 3), (2, 4), (0, 2), (189, 4), (64, 1)])
def test_balanced_partition_is_tensor_split(n, world_size):
    blocks = torch.arange(n).tensor_split(world_size)
    for rank, block in enumerate(blocks):
        p = gp.NodePartition.balanced(n, world_size, rank)
        assert torch.equal(torch.arange(p.start, p.stop), block)


def test_helpers_are_identity_without_partition():
    x = torch.randn(5, 3)
    edge_index = torch.tensor([[0, 1], [1, 0]])
    assert gp.current_partition() is None
    assert gp.gather_nodes(x) is x and gp.scatter_to_owners(x) is x and gp.owned_rows(x) is x
    receivers = edge_index[1]
    assert gp.sum_over_ranks(x) is x and gp.local_receivers(receivers) is receivers
    assert gp.keep_owned_receivers(edge_index, x[:2])[0] is edge_index
    assert gp.owned_slice(5) == slice(0, 5)


def _adjoint_worker(rank, world_size):
    """Rank r weights the gathered rows by (r + 1) * base; x's gradient must be the sum of the
    weights over ranks on x's rows. The reduce-scatter's y-gradient must be the gathered x."""
    n, f = 7, 3
    p = gp.NodePartition.balanced(n, world_size, rank)
    base = torch.arange(n * f, dtype=torch.float64).reshape(n, f)
    x = torch.randn(p.n_owned, f, dtype=torch.float64, requires_grad=True)
    y = torch.randn(n, f, dtype=torch.float64, requires_grad=True)
    with gp.partition_scope(p):
        (gx,) = torch.autograd.grad(gp.sum_over_ranks((gp.gather_nodes(x) * base * (rank + 1)).sum()), x)
        (gy,) = torch.autograd.grad(gp.sum_over_ranks((gp.scatter_to_owners(y) * x.detach()).sum()), y)
        full_x = gp.gather_nodes(x.detach())
    expected = base[p.owned_slice] * world_size * (world_size + 1) / 2
    return {"gx_error": float((gx - expected).abs().max()), "gy": gy, "full_x": full_x}


def test_gather_and_reduce_scatter_are_adjoint():
    out = run_ranks(_adjoint_worker, 3)
    for r in out:
        assert r["gx_error"] < 1e-12
        assert torch.allclose(r["gy"], out[0]["full_x"])


def test_wrong_rows_name_the_fix():
    p = gp.NodePartition.balanced(6, 2, 0)
    with gp.partition_scope(p), pytest.raises(InputError, match="gather_nodes"):
        gp.gather_nodes(torch.zeros(6, 2))


# ---- refusals ----------------------------------------------------------------------------------


def test_graph_partition_refuses_halo_policy():
    with pytest.raises(InputError, match="HaloStoragePolicy does not fit the graph_partition"):
        DistributedModel(toy_model(), DomainConfig(cutoff=4.5, **GP), spec=SPEC_MPNN_HALO)


def test_halo_refuses_graph_partition_policy():
    with pytest.raises(InputError, match="GraphPartitionPolicy does not fit the halo"):
        DistributedModel(toy_model(), DomainConfig(cutoff=4.5), spec=SPEC_MPNN_GP)
    with pytest.raises(InputError, match="GraphPartitionPolicy does not fit the halo"):
        DistributedModel(graph_model(), DomainConfig(cutoff=4.5))  # the model's own spec is GP


def test_partition_unaware_model_is_refused():
    dm = DistributedModel(toy_model(), DomainConfig(cutoff=4.5, **GP), spec=SPEC_MPNN_GP)
    owned = dm.partition(_triclinic())
    with pytest.raises(InputError, match="without asking for its node partition"):
        dm(owned)


def _wrong_batch_worker(rank, world_size, batch):
    dm = DistributedModel(graph_model(), DomainConfig(cutoff=4.5, **GP))
    dm.partition(batch if rank == 0 else None)
    dm(batch)  # the full batch instead of the owned block


def test_full_batch_instead_of_owned_block_is_refused():
    with pytest.raises(RankFailure, match="pass the batch partition\\(\\) returned"):
        run_ranks(_wrong_batch_worker, 2, _triclinic())
