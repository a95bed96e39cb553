"""fairchem's per-edge Wigner matrices under domain decomposition, as one row-local call.

`axis_angle_wigner_hybrid` turns each edge vector (and a random roll angle per edge) into that
edge's rotation matrices: nothing crosses edges, so under the aten dispatch the whole function is
one adapted call on this rank's plain edge rows (`mlipdd.shard.call_adapted`), its outputs the same
edge rows. Op by op it was refused at random: its quaternion blend divides by the constant 1.8,
which some ranks' edge count over atom count equals (the dispatch takes a number equal to a ratio
of local sizes for a count: NOTE [aten counts]); one call is also faster.
"""

from __future__ import annotations

import math

import torch
from mlipdd.shard import call_adapted, is_distributed
from mlipdd.spec import OpAdapter

PER_EDGE = OpAdapter("mlipdd_uma::wigner_per_edge")


def per_edge_wigner(original, edge_distance_vecs, *args, gamma=None, **kwargs):
    """`axis_angle_wigner_hybrid`; under DD one row-local call, with fairchem's random roll angle
    per edge drawn like the edges (``rand_like``: the same draw as its ``torch.rand(n_edges)``,
    which the dispatch would refuse as a replicated tensor beside edge rows)."""
    if not is_distributed(edge_distance_vecs):
        return original(edge_distance_vecs, *args, gamma=gamma, **kwargs)
    if gamma is None:
        gamma = torch.rand_like(edge_distance_vecs[:, 0]) * (2 * math.pi)
    return call_adapted(PER_EDGE, lambda vecs, angles: original(vecs, *args, gamma=angles, **kwargs),
                        edge_distance_vecs, gamma)
