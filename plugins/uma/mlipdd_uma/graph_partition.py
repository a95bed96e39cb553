"""Graph-partition mode: fairchem's eSCN-MD on a node partition, through mlipdd's helpers.

Under the graph-partition strategy every rank gets the full geometry and owns one
contiguous block of atoms (`mlipdd.shard.graph_partition`). The adapters here make the
backbone work on that block, the way fairchem's own all-gather graph parallelism does,
but with mlipdd's collectives instead of fairchem's `gp_utils`:

* `eSCNMDBackbone._generate_graph`: fairchem's own periodic graph on the full geometry,
  then only edges with an owned receiver; the per-node inputs become the owned block;
* `Edgewise.forward`: node features of the owned block are all-gathered
  (`gather_nodes`, reduce-scatter adjoint) before the convolution reads senders;
* `compute_energy` / `balance_channels_batched`: per-system sums of owned atoms are
  summed over ranks (`sum_over_ranks`, identity adjoint).

Forces then are each rank's gradient of its own partial energy with respect to the
replicated positions (the strategy sums them over ranks and keeps the owned block), and
the virial fairchem computes from those gradients is a per-rank partial (all-reduced).

Why not fairchem's `gp_utils`: it keeps module-global process groups and all-reduces
forces and stress itself, while mlipdd's strategy owns the reductions (a pipeline may
mix UMA with other models) and must see each output exactly once.
"""

from __future__ import annotations

import torch
from mlipdd.shard.graph_partition import (
    current_partition,
    gather_nodes,
    keep_owned_receivers,
    local_receivers,
    owned_rows,
    sum_over_ranks,
)

from mlipdd_uma.wigner import per_edge_wigner


def gp_generate_graph(original, self, data_dict):
    """Full periodic graph (fairchem's), cut to edges whose receiver this rank owns."""
    graph = original(self, data_dict)
    p = current_partition()
    if p is None:
        return graph
    from fairchem.core.models.uma.escn_md import add_n_empty_edges

    edge_index, distance, vec = keep_owned_receivers(
        graph["edge_index"], graph["edge_distance"], graph["edge_distance_vec"]
    )
    graph = {**graph, "edge_index": edge_index, "edge_distance": distance, "edge_distance_vec": vec}
    # an edgeless rank: fairchem pads the graph with one fake edge on an atom this rank owns;
    # under the aten dispatch its edge rows stay empty (the rules take zero rows, and the cat
    # of a plain fake edge onto distributed edge rows is refused)
    if edge_index.shape[1] == 0 and not _is_aten(edge_index):
        add_n_empty_edges(graph, 1, self.cutoff, fake_atom_idx=p.start)
    data_dict["scatter_target"] = local_receivers(graph["edge_index"][1])
    data_dict["atomic_numbers"] = owned_rows(data_dict["atomic_numbers_full"])
    data_dict["batch"] = owned_rows(data_dict["batch_full"])
    return graph


def gp_edgewise(original, self, x, x_edge, edge_index, wigner, wigner_inv_envelope,
                total_atoms_across_gp_ranks, scatter_target=None, gp_ctx=None):
    """`Edgewise.forward` reading sender features from the all-gathered node set.

    Runs the convolution in one piece: fairchem's activation-checkpoint chunking only
    saves memory, and mlipdd loads models with it off.
    """
    if current_partition() is None:
        return original(self, x, x_edge, edge_index, wigner, wigner_inv_envelope,
                        total_atoms_across_gp_ranks, scatter_target, gp_ctx)
    x_full = gather_nodes(x)
    return self.forward_chunk(x_full, x.shape[0], x_edge, edge_index, wigner,
                              wigner_inv_envelope, scatter_target)


def gp_compute_energy(original, *args, **kwargs):
    """`compute_energy`: the owned atoms' energy summed over ranks; the unreduced
    partial stays what autograd differentiates (fairchem's own convention)."""
    energy, energy_part = original(*args, **kwargs)
    return sum_over_ranks(energy), energy_part


def gp_balance_channels(original, emb, target, natoms, batch, start_idx, end_idx, target_offset=0.0):
    """`balance_channels_batched` with the owned atoms' per-system sums summed over ranks."""
    if current_partition() is None:
        return original(emb, target, natoms, batch, start_idx, end_idx, target_offset)
    channels = emb[:, 0, start_idx:end_idx]
    sums = torch.zeros((natoms.shape[0], end_idx - start_idx), dtype=emb.dtype, device=emb.device)
    sums = sum_over_ranks(sums.index_add(0, batch, channels))
    corrections = (sums - (target - target_offset).unsqueeze(1)) / natoms.unsqueeze(1)
    out = emb.clone()
    out[:, 0, start_idx:end_idx] = channels - corrections[batch]
    return out


def gp_wigner(original, edge_distance_vecs, *args, **kwargs):
    """`axis_angle_wigner_hybrid` as one row-local call under DD (`mlipdd_uma.wigner`)."""
    return per_edge_wigner(original, edge_distance_vecs, *args, **kwargs)


# NOTE [MoLE under the aten dispatch]
# A mixture-of-experts backbone (released UMA-S) mixes one expert weight per system and
# applies it to that system's edge rows: `set_MOLE_sizes` counts each system's edges
# (an in-place ``scatter_(reduce="add")`` into a per-system table, which the aten
# dispatch would make a count over ALL ranks' edges) and `MOLE.forward` slices the edge
# rows by those counts (Python ints of this rank). Under the aten dispatch the system of
# each edge is kept instead, as edge rows (``batch_full[receiver]``), and each system's
# weight is applied where the edge belongs to it: row-local ops the rules know, and the
# gradient of the replicated weights sums over ranks by the rules. One system: one linear.
def _is_aten(t) -> bool:
    from mlipdd.shard.aten import ShardTensor

    return isinstance(t, ShardTensor)


def aten_set_mole_sizes(original, self, nsystems, batch_full, edge_index):
    """`eSCNMDMoeBackbone.set_MOLE_sizes` under the aten dispatch (NOTE [MoLE under the aten dispatch])."""
    if not _is_aten(edge_index) or self.num_experts == 0:
        return original(self, nsystems, batch_full, edge_index)
    from mlipdd.shard.aten.tensor import unwrap

    edge_system = batch_full[edge_index[1]]  # edge rows: the system of each edge
    plain = unwrap(edge_system)
    local_sizes = torch.zeros(nsystems, dtype=torch.int, device=plain.device).index_add_(
        0, plain, torch.ones_like(plain, dtype=torch.int))
    self.global_mole_tensors.mole_sizes = local_sizes.cpu()  # this rank's counts, for fairchem's own readers
    self.global_mole_tensors.mlipdd_edge_system = edge_system


def aten_mole_forward(original, self, x):
    """`MOLE.forward` under the aten dispatch: each system's mixed weight on its own edge rows."""
    edge_system = getattr(self.global_mole_tensors, "mlipdd_edge_system", None)
    if not _is_aten(x) or edge_system is None:
        return original(self, x)
    from fairchem.core.models.uma.nn.matmul import linear_with_folded_batch
    from mlipdd.shard.aten import AtenRefusal

    if self.global_mole_tensors.ac_start_idx != 0:
        raise AtenRefusal("MOLE under the aten dispatch: activation-checkpoint chunks of the edge rows; "
                          "Fix: load the model with activation checkpointing off (mlipdd's loaders do)")
    with torch.autocast(device_type=self.weights.device.type, enabled=False):
        weights = torch.einsum("eoi, be->boi", self.weights, self.global_mole_tensors.expert_mixing_coefficients)
    if weights.shape[0] == 1:
        return linear_with_folded_batch(x, weights[0], bias=self.bias)
    out = None
    for n in range(weights.shape[0]):
        y = linear_with_folded_batch(x, weights[n], bias=self.bias)
        mine = (edge_system == n).reshape(-1, *([1] * (y.dim() - 1)))
        out = torch.where(mine, y, torch.zeros_like(y) if out is None else out)
    return out


ESCN_MD = "fairchem.core.models.uma.escn_md"


def graph_partition_helpers() -> tuple:
    """The adapters, by name (nothing imported until installed)."""
    from mlipdd.spec import MethodAdapter, PythonAdapter

    here = "mlipdd_uma.graph_partition"
    return (
        MethodAdapter(module_path=ESCN_MD, class_name="eSCNMDBackbone", method_name="_generate_graph",
                      replacement=f"{here}:gp_generate_graph"),
        MethodAdapter(module_path="fairchem.core.models.uma.escn_md_block", class_name="Edgewise",
                      method_name="forward", replacement=f"{here}:gp_edgewise"),
        # MLP_EFS_Head looks compute_energy up in escn_md
        PythonAdapter(ESCN_MD, "compute_energy", f"{here}:gp_compute_energy", pass_original=True),
        PythonAdapter(ESCN_MD, "balance_channels_batched", f"{here}:gp_balance_channels",
                      pass_original=True),
        PythonAdapter(ESCN_MD, "axis_angle_wigner_hybrid", f"{here}:gp_wigner", pass_original=True),
        MethodAdapter(module_path="fairchem.core.models.uma.escn_moe", class_name="eSCNMDMoeBackbone",
                      method_name="set_MOLE_sizes", replacement=f"{here}:aten_set_mole_sizes"),
        MethodAdapter(module_path="fairchem.core.models.uma.nn.mole", class_name="MOLE", method_name="forward",
                      replacement=f"{here}:aten_mole_forward"),
    )


def uma_graph_partition_spec():
    """`GraphPartitionPolicy` + the adapters above; stress is a per-rank partial."""
    from mlipdd.spec import DistributionSpec, GraphPartitionPolicy, MLIPSpec

    from mlipdd_uma.spec import UMA_OUTPUTS

    return MLIPSpec(
        distribution=DistributionSpec(GraphPartitionPolicy(), third_party_helpers=graph_partition_helpers()),
        output_kinds=UMA_OUTPUTS,
        all_reduce_outputs=frozenset({"stress"}),
        name="uma_graph_partition",
    )
