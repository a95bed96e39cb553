"""Models that COUNT the listed edges, at the default skin, under the aten dispatch (NOTE [skin edges]).

GCN degrees by ``torch.bincount(receiver)`` (the idiom zoo's GCNDegreeNorm) and a mean over a
receiver's edges by a count of ones (`mlipdd.testing.idiom_zoo.segments.MeanOverListedEdges`) count every edge of the list; the ranks' lists reach ``cutoff + skin``, one process's only the cutoff. The zoo runs them at
skin 0, where they were exact; at the default skin 0.5 GCNDegreeNorm was 1.1e-3 off in energy with every
op through an exact rule. Halo and sharded storage at 2/3/4 gloo ranks, float64, triclinic, a cell whose
ranks see their own images, a slab with vacuum, the default skin and a wide one: energy, forces and stress
to 1e-10 relative of one process.
"""

from __future__ import annotations

import pytest
from mlipdd.testing.conformance import cases_off
from mlipdd.testing.idiom_zoo import ZOO
from mlipdd.testing.idiom_zoo.segments import MeanOverListedEdges
from mlipdd.testing.systems import slab, small_cell, triclinic

MODELS = {"GCNDegreeNorm": ZOO["GCNDegreeNorm"], "MeanOverListedEdges": MeanOverListedEdges}


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_edge_counting_models_equal_one_process_at_a_skin(world_size):
    systems = {"triclinic": triclinic(species=(1, 8), spacing=2.6, reps=4),
               "small_cell": small_cell(species=(1, 8), spacing=2.6, reps=3),
               "slab": slab(species=(1, 8), spacing=2.6, reps=(4, 4, 2))}
    cases, names = [], []
    for model, factory in MODELS.items():
        for strategy in ("halo", "sharded"):
            for skin in (None, 1.0):  # None: DomainConfig's default (0.5)
                options = {"strategy": strategy, **({} if skin is None else {"skin": skin})}
                for name, batch in systems.items():
                    cases.append((factory, batch, options))
                    names.append(f"{model}/{strategy}/skin {skin or 'default'}/{name}")
    bad = cases_off(cases, names, world_size)
    assert not bad, f"{world_size} ranks differ from one process: {bad}"


def test_a_list_with_no_skin_edge_says_it_reaches_the_cutoff():
    """Every rank's trimmed list reports the model's cutoff, also a rank where no edge lay in
    the skin: a model that skips its own filter on a list within its radius (MACE) must decide
    alike on every rank, or the filter's collectives run on some ranks only (a hang, found at
    MACE 3 ranks)."""
    import torch
    from mlipdd.neighbors import NeighborList
    from mlipdd.strategy.skin import edges_in_cutoff

    positions = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.9, 0.0]], dtype=torch.float64)
    cell, system = torch.eye(3, dtype=torch.float64).view(1, 3, 3) * 20.0, torch.zeros(3, dtype=torch.long)
    for pairs, kept in (([[0, 1], [1, 0]], 2), ([[0, 1, 0, 2], [1, 0, 2, 0]], 2)):
        index = torch.tensor(pairs)
        listed = NeighborList(index, torch.zeros(index.shape[1], 3, dtype=torch.float64), cutoff=3.5)
        trimmed = edges_in_cutoff(listed, positions, cell, system, cutoff=2.5)
        assert trimmed.cutoff == 2.5 and trimmed.num_edges == kept
