"""Reductions over the atom rows reached through a view, a fused op or another spelling.

Each model normalises or pools its features over ALL atoms of the system between two
message-passing layers, as a single-system model is often written: the atom
dimension is reached through a transpose, a flatten, a reshape, a negative index, an
added batch dimension, an einsum, or hidden inside a library call (cov, normalize,
batch norm, var_mean). The pooled value goes back into every atom's features.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mlipdd.testing.idiom_zoo._base import TwoLayerZooModel, ZooModel


class TransposeMean(TwoLayerZooModel):
    idiom = "h - h.t().mean(1): mean over atoms through a transpose"

    def idiom_step(self, h, e, batch, positions, cell):
        return h - h.t().mean(1)


class FlattenMean(TwoLayerZooModel):
    idiom = "h - h.flatten().mean(): mean over atoms and features of a flattened view"

    def idiom_step(self, h, e, batch, positions, cell):
        return h - h.flatten().mean()


class ReshapeSum(TwoLayerZooModel):
    idiom = "h.reshape(-1, k).sum(0): group pooling after a reshape"

    def idiom_step(self, h, e, batch, positions, cell):
        half = self.features // 2
        pooled = h.reshape(-1, half).sum(0)  # atoms x two feature groups, pooled
        return h * (1.0 + 0.05 * torch.tanh(pooled).repeat(2))


class NegativeDimSum(TwoLayerZooModel):
    idiom = "h.sum(dim=-2): sum over atoms by a negative dim"

    def idiom_step(self, h, e, batch, positions, cell):
        return h + 0.02 * torch.tanh(h.sum(dim=-2))


class TupleDimKeepdimMean(TwoLayerZooModel):
    idiom = "torch.mean(h, dim=(0,), keepdim=True)"

    def idiom_step(self, h, e, batch, positions, cell):
        return h - torch.mean(h, dim=(0,), keepdim=True)


class PermutedAtomSum(TwoLayerZooModel):
    idiom = "h.permute(1, 0).sum(1): sum over atoms after a permute"

    def idiom_step(self, h, e, batch, positions, cell):
        return h + 0.02 * torch.tanh(h.permute(1, 0).sum(1))


class BatchedLayoutMean(TwoLayerZooModel):
    """TorchANI keeps (conformations, atoms, features); a molecule-level mean is over dim 1."""

    idiom = "h.unsqueeze(0).mean(dim=1): (1, atoms, F) layout, mean over dim 1"

    def idiom_step(self, h, e, batch, positions, cell):
        x = h.unsqueeze(0)
        molecule = x.mean(dim=1, keepdim=True)
        return (x + torch.tanh(molecule)).squeeze(0)


class Covariance(TwoLayerZooModel):
    idiom = "torch.cov(h.T): feature covariance over atoms"

    def idiom_step(self, h, e, batch, positions, cell):
        c = torch.cov(h.T)
        return h + 0.1 * torch.tanh(h @ c)


class NormalizeOverAtoms(TwoLayerZooModel):
    idiom = "F.normalize(h, dim=0): unit columns over atoms"

    def idiom_step(self, h, e, batch, positions, cell):
        return h + torch.tanh(4.0 * F.normalize(h, dim=0))


class StandardiseOverAtoms(TwoLayerZooModel):
    idiom = "(h - h.mean(0)) / h.std(0): batch-norm-style standardisation"

    def idiom_step(self, h, e, batch, positions, cell):
        return (h - h.mean(0)) / h.std(0)


class VarMeanOverAtoms(TwoLayerZooModel):
    idiom = "torch.var_mean(h, dim=0): fused statistics over atoms"

    def idiom_step(self, h, e, batch, positions, cell):
        var, mean = torch.var_mean(h, dim=0, unbiased=False)
        return (h - mean) * torch.rsqrt(var + 1e-5)


class BatchNormModule(TwoLayerZooModel):
    """nn.BatchNorm1d without running statistics normalises by the batch's atoms."""

    idiom = "nn.BatchNorm1d(track_running_stats=False) over atoms"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = self.seeded(nn.BatchNorm1d(self.features, track_running_stats=False))

    def idiom_step(self, h, e, batch, positions, cell):
        return self.norm(h)


class GramEinsum(TwoLayerZooModel):
    idiom = "einsum('nf,ng->fg') then einsum('nf,fg->ng'): atoms and features mixed"

    def idiom_step(self, h, e, batch, positions, cell):
        gram = torch.einsum("nf,ng->fg", h, h)
        return h + 0.1 * torch.tanh(0.05 * torch.einsum("nf,fg->ng", h, gram))


class GlobalAttention(TwoLayerZooModel):
    """Transformer-style self-attention over all atoms of the system, the atoms as the
    sequence (scaled_dot_product_attention over dim -2)."""

    idiom = "F.scaled_dot_product_attention over all atoms (atoms as the sequence)"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        f = self.features
        self.query, self.key, self.value = self.weight(f, f), self.weight(f, f), self.weight(f, f)

    def idiom_step(self, h, e, batch, positions, cell):
        q, k, v = (h @ self.query)[None], (h @ self.key)[None], (h @ self.value)[None]
        return h + torch.tanh(F.scaled_dot_product_attention(q, k, v)[0])


class CatLayerReadouts(ZooModel):
    """Per-layer readouts concatenated along the atoms, then viewed as (layers, atoms)."""

    idiom = "torch.cat(per-layer readouts).view(L, -1).sum(0)"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.heads = nn.ParameterList([self.weight(self.features) for _ in range(2)])

    def atomic_energies(self, batch, positions, cell):
        e = self.edges(batch, positions, cell)
        h = self.embed[batch.atomic_numbers]
        readouts = []
        for layer, head in enumerate(self.heads):
            h = self.interaction(layer, h, e)
            readouts.append(h @ head)
        return torch.cat(readouts).view(len(readouts), -1).sum(0)


VIEWS = [TransposeMean, FlattenMean, ReshapeSum, NegativeDimSum, TupleDimKeepdimMean, PermutedAtomSum,
         BatchedLayoutMean, Covariance, NormalizeOverAtoms, StandardiseOverAtoms, VarMeanOverAtoms,
         BatchNormModule, GramEinsum, GlobalAttention, CatLayerReadouts]
