"""Aggregations over a receiver's edges, or a system's atoms, spelled without index_add.

Segment reductions over sorted receivers (``torch.segment_reduce``, a cumsum and
differences), degree normalisation by ``torch.bincount``, an AIMNet/TorchANI-style
dense padded neighbour matrix, attention softmax over each receiver's edges (GAT),
edge statistics after a boolean filter, an average neighbour count from the list's
size, and per-system pooling by cumsum, by amax, by a bincount mean, by splitting the
rows per system, a state broadcast by repeat_interleave, and a MEGNet-style global state.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mlipdd.testing.idiom_zoo._base import TwoLayerZooModel, ZooModel


class _CustomAggregation(ZooModel):
    """Two layers whose FIRST aggregation is the model's own ``aggregate``: the second
    layer reads its rows by sender, so missing ghost rows reach the energy."""

    def aggregate(self, messages, e, n_atoms):
        raise NotImplementedError

    def atomic_energies(self, batch, positions, cell):
        e = self.edges(batch, positions, cell)
        h = self.embed[batch.atomic_numbers]
        messages = (e.rbf @ self.filters[0]) * h[e.sender]
        h = h + torch.tanh(self.aggregate(messages, e, h.shape[0]) @ self.updates[0])
        h = self.interaction(1, h, e)
        return self.energy(h)


class SegmentReduce(_CustomAggregation):
    idiom = "torch.segment_reduce(sum) over edges sorted by receiver"

    def aggregate(self, messages, e, n_atoms):
        order = torch.argsort(e.receiver, stable=True)
        lengths = torch.bincount(e.receiver, minlength=n_atoms)
        return torch.segment_reduce(messages[order], "sum", lengths=lengths, axis=0)


class CumsumSegments(_CustomAggregation):
    idiom = "segment sums by sorted receivers + cumsum + differences"

    def aggregate(self, messages, e, n_atoms):
        order = torch.argsort(e.receiver, stable=True)
        counts = torch.bincount(e.receiver, minlength=n_atoms)
        ptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        running = torch.cat([messages.new_zeros(1, messages.shape[1]), torch.cumsum(messages[order], 0)])
        return running[ptr[1:]] - running[ptr[:-1]]


class GCNDegreeNorm(_CustomAggregation):
    idiom = "GCN normalisation deg^-1/2 by torch.bincount(receiver)"

    def aggregate(self, messages, e, n_atoms):
        degree = torch.bincount(e.receiver, minlength=n_atoms).to(messages.dtype).clamp(min=1.0)
        norm = degree[e.sender].rsqrt() * degree[e.receiver].rsqrt()
        return messages.new_zeros(n_atoms, messages.shape[1]).index_add(0, e.receiver, norm[:, None] * messages)


class MeanOverListedEdges(_CustomAggregation):
    """Messages averaged over a receiver's LISTED edges, their count an index_add of ones: it
    counts the edges of a list with a skin too. Not in the zoo's table (its cases run at skin 0,
    where it is a plain mean); the skin tests use it (NOTE [skin edges])."""

    idiom = "mean over a receiver's listed edges (count by index_add of ones)"

    def aggregate(self, messages, e, n_atoms):
        count = messages.new_zeros(n_atoms).index_add(0, e.receiver, torch.ones_like(e.distance))
        total = messages.new_zeros(n_atoms, messages.shape[1]).index_add(0, e.receiver, messages)
        return total / count.clamp(min=1.0).unsqueeze(1)


class PaddedNeighbourMatrix(ZooModel):
    """AIMNet/TorchANI-style: a dense (atoms, max neighbours) table of sender indices,
    built by sorting, a bincount and cumsum offsets, padded with a dummy zero row."""

    idiom = "dense padded neighbour matrix: sort, cumsum offsets, index_select, sum(1)"

    def atomic_energies(self, batch, positions, cell):
        e = self.edges(batch, positions, cell)
        n = positions.shape[0]
        order = torch.argsort(e.receiver, stable=True)
        receiver, sender = e.receiver[order], e.sender[order]
        counts = torch.bincount(receiver, minlength=n)
        offsets = torch.cumsum(counts, 0) - counts
        slot = torch.arange(receiver.shape[0], device=receiver.device) - offsets[receiver]
        width = int(counts.max())
        neighbours = torch.full((n, width), n, dtype=torch.long, device=receiver.device)
        neighbours[receiver, slot] = sender
        edge_ids = torch.full((n, width), receiver.shape[0], dtype=torch.long, device=receiver.device)
        edge_ids[receiver, slot] = order
        h = self.embed[batch.atomic_numbers]
        padded_h = torch.cat([h, h.new_zeros(1, h.shape[1])])
        padded_rbf = torch.cat([e.rbf, e.rbf.new_zeros(1, e.rbf.shape[1])])
        gathered = padded_h.index_select(0, neighbours.flatten()).view(n, width, -1)
        filters = (padded_rbf.index_select(0, edge_ids.flatten()) @ self.filters[0]).view(n, width, -1)
        h = h + torch.tanh((gathered * filters).sum(1) @ self.updates[0])
        h = self.interaction(1, h, e)
        return self.energy(h)


class _Attention(ZooModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.att_sender = self.weight(self.features)
        self.att_receiver = self.weight(self.features)
        self.att_radial = self.weight(self.n_basis)
        self.value = self.weight(self.features, self.features)

    def logits(self, h, e):
        return F.leaky_relu(h[e.sender] @ self.att_sender + h[e.receiver] @ self.att_receiver
                            + e.rbf @ self.att_radial, 0.2)

    def shifted(self, logits, e, n_atoms):
        raise NotImplementedError

    def atomic_energies(self, batch, positions, cell):
        e = self.edges(batch, positions, cell)
        h = self.interaction(0, self.embed[batch.atomic_numbers], e)
        n = h.shape[0]
        weights = torch.exp(self.shifted(self.logits(h, e), e, n)) * e.envelope
        denominator = h.new_zeros(n).index_add(0, e.receiver, weights) + 1e-16
        alpha = weights / denominator[e.receiver]
        h = h + torch.tanh(torch.zeros_like(h).index_add(0, e.receiver, alpha[:, None] * (h[e.sender] @ self.value)))
        h = self.interaction(1, h, e)
        return self.energy(h)


class GATGlobalShift(_Attention):
    idiom = "GAT softmax over receiver's edges (scatter of exp / sum), global max shift"

    def shifted(self, logits, e, n_atoms):
        return logits - logits.max().detach()


class GATSegmentMax(_Attention):
    idiom = "GAT softmax with per-receiver max by scatter_reduce('amax')"

    def shifted(self, logits, e, n_atoms):
        peak = logits.new_zeros(n_atoms).scatter_reduce(0, e.receiver, logits, "amax", include_self=False)
        return logits - peak[e.receiver].detach()


class MaskedEdgeMean(TwoLayerZooModel):
    """Edges filtered with a boolean mask (the short ones), then a mean over edges."""

    idiom = "e = rbf[d < r_inner]; e.mean(0): edge mean after a boolean filter"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mix = self.weight(self.n_basis, self.features)

    def idiom_step(self, h, e, batch, positions, cell):
        short = e.rbf[e.distance < 0.8 * self.cutoff]
        return h * (1.0 + torch.tanh(short.mean(0) @ self.mix))


class AverageNeighbourCount(_CustomAggregation):
    """Messages normalised by the batch's average neighbour count, from the list's size."""

    idiom = "messages / (n_edges / n_atoms): average degree from tensor sizes"

    def aggregate(self, messages, e, n_atoms):
        average = e.sender.shape[0] / n_atoms
        return messages.new_zeros(n_atoms, messages.shape[1]).index_add(0, e.receiver, messages) / average


class PerSystemCumsum(TwoLayerZooModel):
    """Per-system mean features from a cumsum over the (system-sorted) atom rows and
    the batch's ``ptr`` offsets, broadcast back by ``batch.batch``."""

    idiom = "cumsum over float atom rows + ptr differences (per-system mean)"

    def idiom_step(self, h, e, batch, positions, cell):
        ptr = batch.ptr
        running = torch.cat([h.new_zeros(1, h.shape[1]), torch.cumsum(h, 0)])
        means = (running[ptr[1:]] - running[ptr[:-1]]) / (ptr[1:] - ptr[:-1]).to(h.dtype)[:, None]
        return h + torch.tanh(means[batch.batch])


class SystemMaxPool(TwoLayerZooModel):
    idiom = "per-system max pooling: scatter_reduce('amax') into system rows"

    def idiom_step(self, h, e, batch, positions, cell):
        index = batch.batch[:, None].expand_as(h)
        pooled = h.new_zeros(batch.num_systems, h.shape[1]).scatter_reduce(0, index, h, "amax", include_self=False)
        return h + torch.tanh(pooled)[batch.batch]


class PerSystemMeanByBincount(TwoLayerZooModel):
    """PyG's global_mean_pool by hand: per-system sums over counts from bincount."""

    idiom = "per-system mean: index_add sums / torch.bincount(batch) counts"

    def idiom_step(self, h, e, batch, positions, cell):
        sums = h.new_zeros(batch.num_systems, h.shape[1]).index_add(0, batch.batch, h)
        counts = torch.bincount(batch.batch, minlength=batch.num_systems).to(h.dtype)
        return h + torch.tanh(sums / counts[:, None])[batch.batch]


class PerSystemSplit(TwoLayerZooModel):
    """Per-system pooling by splitting the atom rows into each system's block."""

    idiom = "torch.split(h, atoms_per_system.tolist()), chunk.mean(0) per system"

    def idiom_step(self, h, e, batch, positions, cell):
        chunks = torch.split(h, batch.atoms_per_system.tolist())
        pooled = torch.stack([chunk.mean(0) for chunk in chunks])
        return h + torch.tanh(pooled)[batch.batch]


class RepeatInterleaveState(TwoLayerZooModel):
    """matgl-style broadcast of a per-system state to the atoms by repeat_interleave."""

    idiom = "per-system index_add sums, torch.repeat_interleave(state, atoms_per_system)"

    def idiom_step(self, h, e, batch, positions, cell):
        sums = h.new_zeros(batch.num_systems, h.shape[1]).index_add(0, batch.batch, h)
        state = torch.tanh(0.05 * sums)
        return h + torch.repeat_interleave(state, batch.atoms_per_system, dim=0)


class GlobalStateMEGNet(ZooModel):
    """MEGNet: a global state updated from the mean over atoms each block and fed back
    to every atom by concatenation."""

    idiom = "MEGNet global state u from h.mean(0), u.expand(n, -1) concatenated"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        f = self.features
        self.state0 = self.weight(f, scale=0.1)
        self.state_update = nn.ModuleList([self.seeded(nn.Linear(2 * f, f)) for _ in range(2)])
        self.atom_update = nn.ModuleList([self.seeded(nn.Linear(2 * f, f)) for _ in range(2)])

    def atomic_energies(self, batch, positions, cell):
        e = self.edges(batch, positions, cell)
        h = self.embed[batch.atomic_numbers]
        u = self.state0
        for layer in range(2):
            h = self.interaction(layer, h, e)
            u = torch.tanh(self.state_update[layer](torch.cat([u, h.mean(0)])))
            h = h + torch.tanh(self.atom_update[layer](torch.cat([h, u.expand(h.shape[0], -1)], dim=1)))
        return self.energy(h)


SEGMENTS = [SegmentReduce, CumsumSegments, GCNDegreeNorm, PaddedNeighbourMatrix, GATGlobalShift, GATSegmentMax,
            MaskedEdgeMean, AverageNeighbourCount, PerSystemCumsum, SystemMaxPool, PerSystemMeanByBincount,
            PerSystemSplit, RepeatInterleaveState, GlobalStateMEGNet]
