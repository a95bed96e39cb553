"""Idioms that pick, order or count particular atom rows.

A row read by position (``h[0]``), atoms sorted or ranked by a feature (sort pooling,
top-k pooling, argmax), tables indexed by element (an element table filled by
``index_add``, a table over ``torch.unique`` of the species, a boolean mask of one
element), self-loops over every row, and a half neighbour list made by comparing atom indices.
"""

from __future__ import annotations

import torch
from torch import nn

from mlipdd.testing.idiom_zoo._base import TwoLayerZooModel


class FirstAtomContext(TwoLayerZooModel):
    """The first atom's features as a context every atom reads (a "CLS" row)."""

    idiom = "h + tanh(h[0]): reads the row of atom 0"

    def idiom_step(self, h, e, batch, positions, cell):
        return h + torch.tanh(h[0])


class SortPooling(TwoLayerZooModel):
    """DGCNN's SortPooling: atoms sorted by their last channel, the top k rows flattened
    into a global descriptor."""

    idiom = "torch.sort over atoms, the first k sorted rows pooled"

    def __init__(self, k: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.k = k
        self.pool = self.weight(k * self.features, self.features, scale=0.05)

    def idiom_step(self, h, e, batch, positions, cell):
        order = torch.sort(h[:, -1], descending=True).indices
        top = h[order[: self.k]].reshape(-1)
        return h + torch.tanh(top @ self.pool)


class TopKPooling(TwoLayerZooModel):
    """gPool: the k atoms with the highest projection score, gated by their score."""

    idiom = "torch.topk over atoms (gPool)"

    def __init__(self, k: int = 5, **kwargs):
        super().__init__(**kwargs)
        self.k = k
        self.score = self.weight(self.features)

    def idiom_step(self, h, e, batch, positions, cell):
        values, index = torch.topk(h @ self.score, self.k)
        pooled = (h[index] * torch.tanh(values)[:, None]).mean(0)
        return h + 0.5 * torch.tanh(pooled)


class MaxWithIndices(TwoLayerZooModel):
    """``x.max(dim=0)`` gives the most salient atom; every atom reads its features."""

    idiom = "score.max(dim=0) -> (values, indices), h[indices]"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.score = self.weight(self.features)

    def idiom_step(self, h, e, batch, positions, cell):
        best = (h @ self.score).max(dim=0)
        return h + torch.tanh(h[best.indices]) * torch.sigmoid(best.values)


class ElementMeans(TwoLayerZooModel):
    """Per-element mean features (an element table filled by index_add, divided by the
    element counts), subtracted from every atom of that element."""

    idiom = "index_add into a 119-row element table, divided by counts"

    def idiom_step(self, h, e, batch, positions, cell):
        z = batch.atomic_numbers
        sums = h.new_zeros(119, h.shape[1]).index_add(0, z, h)
        counts = h.new_zeros(119).index_add(0, z, torch.ones_like(h[:, 0]))
        means = sums / counts.clamp(min=1.0)[:, None]
        return h - means[z]


class UniqueSpeciesMeans(TwoLayerZooModel):
    """``torch.unique(z, return_inverse=True)`` builds a table over the species present;
    per-species means are scattered by the inverse index and counted by bincount."""

    idiom = "torch.unique(z, return_inverse) table, index_add / bincount"

    def idiom_step(self, h, e, batch, positions, cell):
        species, inverse = torch.unique(batch.atomic_numbers, return_inverse=True)
        sums = h.new_zeros(species.shape[0], h.shape[1]).index_add(0, inverse, h)
        counts = torch.bincount(inverse, minlength=species.shape[0]).to(h.dtype)
        return h - 0.5 * (sums / counts[:, None])[inverse]


class SpeciesMaskedMean(TwoLayerZooModel):
    """The mean over the atoms of one element, selected by a boolean mask (water models
    often pool over the oxygens)."""

    idiom = "h[z == 8].mean(0): mean over the atoms of one element"

    def idiom_step(self, h, e, batch, positions, cell):
        oxygens = h[batch.atomic_numbers == 8]
        return h + torch.tanh(oxygens.mean(0))


class SelfLoops(TwoLayerZooModel):
    """GCN-style: every atom also messages itself, edges appended with an arange."""

    idiom = "self-loops: torch.arange(positions.shape[0]) appended to the edges"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.self_filter = self.weight(self.features)

    def idiom_step(self, h, e, batch, positions, cell):
        loops = torch.arange(positions.shape[0], device=positions.device)
        sender = torch.cat([e.sender, loops])
        receiver = torch.cat([e.receiver, loops])
        weights = torch.cat([e.rbf @ self.filters[0], self.self_filter.expand(loops.shape[0], -1)])
        messages = weights * h[sender]
        return h + torch.tanh(torch.zeros_like(h).index_add(0, receiver, messages) @ self.updates[0])


class HalfListPairs(TwoLayerZooModel):
    """A pair repulsion counted once per pair: the half list ``sender < receiver``."""

    idiom = "half list by index comparison: edges with sender < receiver"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.strength = nn.Parameter(torch.tensor(0.7, dtype=self.dtype))

    def atomic_energies(self, batch, positions, cell):
        e = self.edges(batch, positions, cell)
        keep = e.sender < e.receiver
        pair = self.strength * torch.exp(-e.distance[keep]) * e.envelope[keep]
        repulsion = positions.new_zeros(positions.shape[0]).index_add(0, e.receiver[keep], pair)
        return super().atomic_energies(batch, positions, cell) + repulsion

    def idiom_step(self, h, e, batch, positions, cell):
        return h


ROWS = [FirstAtomContext, SortPooling, TopKPooling, MaxWithIndices, ElementMeans, UniqueSpeciesMeans,
        SpeciesMaskedMean, SelfLoops, HalfListPairs]
