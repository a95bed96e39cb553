"""What the ShardTensor dispatch cannot see in aimnet's code, and what replaces it under DD.

One thing: aimnet's per-system sum `aimnet.nbops.mol_sum` (flat layout) accumulates with
an in-place ``res.scatter_add_(0, idx, x)`` and returns ``res`` without rebinding the
call's result. Across ranks a per-system sum is a local sum plus an all_reduce, which
cannot happen in place, so the dispatch answers with a new tensor and the dropped one
would be stale. The replacement is the same sum with the result rebound; the dispatch
then turns it into owned rows + all_reduce (a replicated value, whose reads per atom in
aimnet's charge equilibration carry their gradient back to every rank).

Compiled at several ranks (``DomainConfig(compile=True)``) the rows are plain tensors with
a deep ghost shell and an owned-row marker (`mlipdd.distributed.compiled_sums`): the sum
is then the owned rows' only, completed over ranks inside the compiled graph.

Everything else aimnet does on this layout is per-row arithmetic, reads of neighbour
rows through ``index_select`` (routed to the owners under sharded storage) and sums
over the neighbour-slot dimension of a row, all of which the dispatch handles.

Halo storage needs one more: aimnet's convolution (`ConvSV.forward`) sums over a row's
neighbour slots, a contraction rather than a scatter, so the dispatch has no scatter
through which to refresh ghost rows; a ghost row has no neighbours in this rank's
matrix (edges live with their receiver's owner) and would keep a zero environment.
`halo_refreshed_convolution` copies every owner's result onto its ghost rows after the
convolution (and sends the ghosts' gradients home in the backward).
"""

from __future__ import annotations

import torch
from mlipdd.distributed.compiled_sums import OWNED_ROWS, system_sum


def rebinding_mol_sum(original, x: torch.Tensor, data: dict) -> torch.Tensor:
    """`aimnet.nbops.mol_sum` with its scatter's result rebound (flat layout only)."""
    from aimnet import nbops

    if nbops.get_nb_mode(data) != 1:
        return original(x, data)
    owned = data.get(OWNED_ROWS)
    if owned is not None:  # compile=True at several ranks: owned rows, summed over ranks in the graph
        return system_sum(x, data["mol_idx"], data["charge"].shape[0], owned)
    index = data["mol_idx"].to(torch.long)
    n_systems = int(data["_num_mol"].item())
    if x.ndim == 1:
        out = torch.zeros((n_systems,), dtype=x.dtype, device=x.device)
        return out.scatter_add(0, index, x)
    if x.ndim != 2:
        raise ValueError(f"mol_sum on the flat layout takes 1-D or 2-D values, got shape {tuple(x.shape)}")
    out = torch.zeros((n_systems, x.shape[1]), dtype=x.dtype, device=x.device)
    return out.scatter_add(0, index.unsqueeze(-1).expand(-1, x.shape[1]), x)


def halo_refreshed_convolution(original, self, data: dict, a: torch.Tensor) -> torch.Tensor:
    """`aimnet.modules.aev.ConvSV.forward`, then ghost rows take their owner's result."""
    # the aten dispatch refreshes the ghost rows itself (its scatter rules): nothing to add
    return original(self, data, a)


def aimnet2_helpers(halo: bool = False) -> tuple:
    """The adapters installed around a distributed forward (named, so nothing is imported yet)."""
    from mlipdd.spec import MethodAdapter, PythonAdapter

    helpers = [PythonAdapter("aimnet.nbops", "mol_sum", "mlipdd_aimnet2.adapters:rebinding_mol_sum",
                             pass_original=True)]
    if halo:
        helpers.append(MethodAdapter(module_path="aimnet.modules.aev", class_name="ConvSV", method_name="forward",
                                     replacement="mlipdd_aimnet2.adapters:halo_refreshed_convolution"))
    return tuple(helpers)
