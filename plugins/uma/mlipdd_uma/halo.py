"""Halo mode: the adapters that let fairchem's eSCN-MD run on ``[owned | ghost]`` rows.

Under the spatial halo strategy the model gets padded positions as a ShardTensor:
owned atoms, then ghost copies sitting at their periodic images. Most of the backbone
is per-node or per-edge arithmetic that the ShardTensor dispatch already handles
(reads of node rows are local, out-of-place scatters into node rows refresh the
ghosts, out-of-place scatters into per-system rows become local sum + all_reduce).
What it cannot see, and what these adapters replace while a distributed forward runs:

* graph construction (`eSCNMDBackbone._generate_graph`): fairchem's radius graph on
  the padded rows with open boundaries (ghosts already are the images), keeping only
  edges whose receiver is owned: each edge then lives on exactly one rank;
* the edge -> node scatter of every layer (`Edgewise.forward_chunk`): fairchem
  accumulates with an in-place ``index_add_`` whose result it does not rebind, so the
  ghost refresh is applied here to the backend's local partial;
* per-system sums with a dropped in-place result (`reduce_node_to_system`,
  `balance_channels_batched`): rebinding versions, which the dispatch turns into owned
  rows + all_reduce;
* the virial (`compute_forces_and_stress`): every padded row, ghost copies included,
  contributes ``g (x) x`` with its own coordinates, giving a per-rank partial stress
  (the spec declares ``stress`` all-reduced);
* `UMAWrapper.place_in_cell`: ghosts must stay where the strategy put them.

Each replacement falls back to the original when its input is a plain tensor (one
rank gets plain tensors), so installing them is harmless outside halo runs.

# NOTE [UMA under the aten dispatch]
The rows are `mlipdd.shard.aten.ShardTensor`s, whose rules
keep in-place scatters in place and reduce per-system sums themselves: fairchem's own
edge -> node scatter, `reduce_node_to_system` and `balance_channels_batched` run as
written. Three adapters stay: the graph (open boundaries on the padded rows, owned
receivers; its edge count becomes the forward's, `set_edge_count`), the positions
(ghosts stay at their images) and the virial, which needs each ghost row's OWN image
coordinate times its share of the gradient; per-row placements cannot say that (a ghost
row of positions is an image, not a copy), so it is summed on this rank's plain rows
and all-reduced: the total virial, replicated (the aten consolidation takes it as is).
"""

from __future__ import annotations

import torch
from mlipdd.shard import local
from mlipdd.shard.aten import ShardTensor as AtenShardTensor
from torch.utils._python_dispatch import _disable_current_modes

from mlipdd_uma.wigner import per_edge_wigner


def _is_aten(t) -> bool:
    return isinstance(t, AtenShardTensor)


# ---- graph -------------------------------------------------------------------------------
def padded_radius_graph(backbone, pos: torch.Tensor, system: torch.Tensor, cell: torch.Tensor,
                        n_systems: int) -> torch.Tensor:
    """``edge_index`` (2, E) of fairchem's radius graph over padded rows, open boundaries,
    owned receivers only (``edge_index[1] < n_owned``).

    Runs on plain detached copies: the graph is integer bookkeeping, and plain tensors
    keep sums inside fairchem's neighbour search away from the dispatch. fairchem's
    search wants each system's atoms contiguous, which padded rows are not (ghosts come
    grouped by source rank), so rows are sorted by system first and mapped back after.
    """
    from fairchem.core.graph.compute import generate_graph

    from mlipdd_uma.inputs import UMAInputs

    n_owned = pos._ctx.n_owned
    plain_system = local(system).detach()
    order = torch.argsort(plain_system, stable=True)
    counts = torch.bincount(plain_system, minlength=n_systems)
    no_pbc = torch.zeros((n_systems, 3), dtype=torch.bool, device=plain_system.device)
    view = UMAInputs(
        pos=local(pos).detach()[order],
        cell=local(cell).detach(),
        natoms=counts,
        batch=plain_system[order],
        pbc=no_pbc,
    )
    graph = generate_graph(
        view,
        cutoff=backbone.cutoff,
        max_neighbors=backbone.max_neighbors,
        enforce_max_neighbors_strictly=backbone.enforce_max_neighbors_strictly,
        radius_pbc_version=backbone.radius_pbc_version,
        pbc=no_pbc,
    )
    edge_index = order[local(graph["edge_index"])]
    return edge_index[:, edge_index[1] < n_owned]


def halo_generate_graph(original, self, data_dict):
    """`eSCNMDBackbone._generate_graph` for padded rows (see the module docstring)."""
    if _is_aten(data_dict["pos"]):
        return _aten_generate_graph(self, data_dict)
    return original(self, data_dict)


def _aten_generate_graph(self, data_dict):
    """NOTE [UMA under the aten dispatch]: the same graph, as edge rows of the aten dispatch."""
    from mlipdd.shard.aten import EDGES, AtenRefusal, Rows
    from mlipdd.shard.aten.graph_partition import set_edge_count

    _check_halo_backbone(self)
    pos = data_dict["pos"]
    ctx = pos._ctx
    n_systems = int(data_dict["natoms"].shape[0])
    with _disable_current_modes():  # plain bookkeeping: the factory mode would make its zeros ShardTensors
        plain = padded_radius_graph(self, pos, data_dict["batch"], data_dict["cell"], n_systems)
    if plain.shape[1] == 0:  # fairchem's fake self-loop would be a row of no rank's edges
        raise AtenRefusal(
            "UMA under the aten dispatch: this rank's atoms have no neighbour within the cutoff; "
            "Fix: fewer ranks for this system, or strategy='graph_partition'")
    set_edge_count(ctx, plain.shape[1])
    edge_index = AtenShardTensor(plain, Rows(1, EDGES, values="atoms"), ctx, "UMA's halo graph")
    vec = pos[edge_index[0]] - pos[edge_index[1]]  # edge rows, differentiable to owners and ghosts
    data_dict["scatter_target"] = edge_index[1]
    return {"edge_index": edge_index, "edge_distance": torch.linalg.norm(vec, dim=-1), "edge_distance_vec": vec}


def _check_halo_backbone(self) -> None:
    from fairchem.core.common import gp_utils

    if gp_utils.initialized():
        raise RuntimeError(
            "fairchem graph parallelism is initialised in this process, but the halo strategy "
            "partitions space itself; run the halo strategy without fairchem's gp_utils groups"
        )
    if getattr(self, "num_experts", 0) and getattr(self, "use_composition_embedding", False):
        raise NotImplementedError(
            "this UMA backbone routes its mixture of experts by each system's composition, which "
            "the halo adapters do not reduce across ranks yet (a rank would route by its owned + "
            "ghost atoms); run it with strategy='graph_partition', which sees the whole system"
        )


# ---- message passing and per-system sums: fairchem's own code, through the aten rules


# ---- forces and stress -------------------------------------------------------------------
def halo_forces_and_stress(original, energy_part, pos, cell, batch, training=True):
    """`compute_forces_and_stress` over padded rows: forces on every padded row (the
    strategy sends ghost rows home) and this rank's partial stress.

    Virial = sum over every position copy of ``dE/dx (x) x`` plus the cell term. Ghost
    copies carry their own coordinates (their images), so each rank sums all its padded
    rows; the ranks' partials add up to the single-process virial.
    """
    if _is_aten(pos):
        return _aten_forces_and_stress(energy_part, pos, cell, batch, training)
    return original(energy_part, pos, cell, batch, training)


def _aten_forces_and_stress(energy_part, pos, cell, batch, training):
    """NOTE [UMA under the aten dispatch]: forces as the dispatch's gradient (shares: the
    strategy sums them into owners), the virial of this rank's rows all-reduced."""
    from mlipdd.shard.aten import SHARES, AtenRefusal
    from mlipdd.shard.aten.comm import all_reduce

    grad_pos, grad_cell = torch.autograd.grad([energy_part.sum()], [pos, cell], create_graph=training,
                                              allow_unused=True)
    if not (_is_aten(grad_pos) and getattr(grad_pos._place, "kind", None) == SHARES):
        raise AtenRefusal(
            f"UMA's virial under the aten dispatch needs the position gradient as shares by row, got "
            f"{getattr(grad_pos, '_place', 'a plain tensor')}; Fix: strategy='graph_partition'")
    g, x = grad_pos._local.detach(), pos._local.detach()
    n_systems = cell.shape[0]
    per_row = (g.unsqueeze(2) * x.unsqueeze(1)).reshape(-1, 9).to(torch.float64)
    rows_virial = torch.zeros((n_systems, 9), dtype=torch.float64, device=g.device)
    rows_virial = rows_virial.index_add(0, local(batch).detach(), per_row)
    pos_virial = all_reduce(rows_virial, pos._ctx.group).reshape(n_systems, 3, 3)
    plain_cell = local(cell).detach()
    cell_virial = 0 if grad_cell is None else plain_cell.mT @ local(grad_cell).detach()
    virial = (pos_virial + pos_virial.mT + cell_virial + (cell_virial.mT if grad_cell is not None else 0)) / 2
    volume = torch.det(plain_cell).abs().reshape(-1, 1, 1)
    return -grad_pos, (virial / volume).reshape(-1, 9)


def halo_wigner(original, edge_distance_vecs, *args, **kwargs):
    """`axis_angle_wigner_hybrid` as one row-local call under DD (`mlipdd_uma.wigner`)."""
    return per_edge_wigner(original, edge_distance_vecs, *args, **kwargs)


def keep_positions(original, self, positions, cell, pbc, system):
    """`UMAWrapper.place_in_cell` under halo: ghosts stay at their images (owned atoms
    were wrapped by the strategy when it last migrated them)."""
    if _is_aten(positions):
        return positions
    return original(self, positions, cell, pbc, system)


def _method(module: str, cls: str, method: str, replacement: str):
    from mlipdd.spec import MethodAdapter

    return MethodAdapter(module_path=module, class_name=cls, method_name=method,
                         replacement=f"mlipdd_uma.halo:{replacement}")


def _function(module: str, name: str, replacement: str):
    from mlipdd.spec import PythonAdapter

    return PythonAdapter(module, name, f"mlipdd_uma.halo:{replacement}", pass_original=True)


ESCN_MD = "fairchem.core.models.uma.escn_md"


def halo_helpers() -> tuple:
    """The adapters installed around the distributed forward.

    Written by name (nothing is imported until they are installed), so building the
    preset at plugin discovery does not import fairchem, and a saved spec file can name
    them (the plugin allow-lists ``mlipdd_uma``).
    """
    return (
        _method(ESCN_MD, "eSCNMDBackbone", "_generate_graph", "halo_generate_graph"),
        _method("mlipdd_uma.wrapper", "UMAWrapper", "place_in_cell", "keep_positions"),
        _function(ESCN_MD, "compute_forces_and_stress", "halo_forces_and_stress"),
        _function(ESCN_MD, "axis_angle_wigner_hybrid", "halo_wigner"),
    )
