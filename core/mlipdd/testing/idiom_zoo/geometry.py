"""Idioms that build their own geometry or their own derivatives.

Three-body terms over pairs of edges (sharing the sender; DimeNet's chains k->j->i),
charge equilibration by a dense atoms x atoms matrix and ``torch.linalg.solve``,
forces and virial assembled by the model from edge-vector gradients, and a model
that builds its own all-pairs graph from the positions (minimum image).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from mlipdd.neighbors import attach_neighbors
from mlipdd.testing.idiom_zoo._base import Edges, TwoLayerZooModel, ZooModel, cosine_cutoff


def _pairs_within_groups(group: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All ordered pairs (a, b), a != b, of edges with the same ``group`` value."""
    n_edges = group.shape[0]
    order = torch.argsort(group, stable=True)
    counts = torch.bincount(group, minlength=n_groups)
    start = torch.cumsum(counts, 0) - counts
    per_edge = counts[group]
    first = torch.repeat_interleave(torch.arange(n_edges, device=group.device), per_edge)
    block_start = torch.repeat_interleave(torch.cumsum(per_edge, 0) - per_edge, per_edge)
    local = torch.arange(first.shape[0], device=group.device) - block_start
    second = order[start[group[first]] + local]
    keep = first != second
    return first[keep], second[keep]


class _ThreeBody(TwoLayerZooModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.angular = self.weight(3, self.features)

    def triplets(self, e: Edges, n_atoms: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def idiom_step(self, h, e, batch, positions, cell):
        a, b = self.triplets(e, h.shape[0])
        cos = (e.vectors[a] * e.vectors[b]).sum(-1) / (e.distance[a] * e.distance[b])
        basis = torch.stack([torch.ones_like(cos), cos, cos * cos], dim=1) * (e.envelope[a] * e.envelope[b])[:, None]
        per_edge = e.rbf.new_zeros(e.rbf.shape[0], self.features).index_add(0, a, basis @ self.angular)
        return h + torch.tanh(torch.zeros_like(h).index_add(0, e.receiver, per_edge * h[e.sender]))


class SenderTriplets(_ThreeBody):
    idiom = "three-body: pairs of edges sharing the SENDER (angle at the sender)"

    def triplets(self, e, n_atoms):
        return _pairs_within_groups(e.sender, n_atoms)


class SenderTripletsByMask(_ThreeBody):
    """The same triplets found the dense way: an edges x edges same-sender mask, nonzero."""

    idiom = "three-body: (sender[:, None] == sender[None, :]) mask, nonzero pairs"

    def triplets(self, e, n_atoms):
        same = (e.sender[:, None] == e.sender[None, :]) & ~torch.eye(e.sender.shape[0], dtype=torch.bool)
        a, b = torch.nonzero(same, as_tuple=True)
        return a, b


class DimeNetTriplets(_ThreeBody):
    """DimeNet: for each edge j->i every edge k->j, k->j not the reverse of j->i."""

    idiom = "DimeNet triplets k->j->i (receiver of kj == sender of ji)"

    def triplets(self, e, n_atoms):
        order = torch.argsort(e.receiver, stable=True)
        counts = torch.bincount(e.receiver, minlength=n_atoms)
        start = torch.cumsum(counts, 0) - counts
        incoming = counts[e.sender]  # edges k->j arriving at each edge's sender j
        ji = torch.repeat_interleave(torch.arange(e.sender.shape[0], device=order.device), incoming)
        block_start = torch.repeat_interleave(torch.cumsum(incoming, 0) - incoming, incoming)
        local = torch.arange(ji.shape[0], device=order.device) - block_start
        kj = order[start[e.sender[ji]] + local]
        not_reverse = (e.vectors[ji] + e.vectors[kj]).abs().sum(-1) > 1e-8
        # cos of (j->i, k->j): the angle at j, up to its sign
        return ji[not_reverse], kj[not_reverse]


class _ChargeEquilibration(ZooModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.chi_head = self.weight(self.features)
        self.hardness_head = self.weight(self.features)

    def matrix(self, hardness, e, n):
        raise NotImplementedError

    def atomic_energies(self, batch, positions, cell):
        e = self.edges(batch, positions, cell)
        h = self.interaction(0, self.embed[batch.atomic_numbers], e)
        chi = h @ self.chi_head
        hardness = F.softplus(h @ self.hardness_head) + 1.0
        n = positions.shape[0]
        a = self.matrix(hardness, e, n)
        ones = a.new_ones(n, 1)
        bordered = torch.cat([torch.cat([a, ones], 1), torch.cat([ones.T, a.new_zeros(1, 1)], 1)], 0)
        rhs = torch.cat([-chi, chi.new_zeros(1)])  # neutral system
        q = torch.linalg.solve(bordered, rhs)[:n]
        h = self.interaction(1, h * (1.0 + 0.1 * q[:, None]), e)
        return self.energy(h) + chi * q + 0.5 * q * (a @ q)


class QEqIndexPut(_ChargeEquilibration):
    idiom = "QEq: n x n matrix by index_put(accumulate=True), torch.linalg.solve"

    def matrix(self, hardness, e, n):
        coupling = 0.3 * e.envelope / (1.0 + e.distance)
        a = hardness.new_zeros(n, n).index_put((e.receiver, e.sender), coupling, accumulate=True)
        diagonal = torch.arange(n, device=hardness.device)
        return a.index_put((diagonal, diagonal), hardness, accumulate=True)


class QEqSetItem(_ChargeEquilibration):
    idiom = "QEq: adjacency by A[rcv, snd] = 1, diag_embed, torch.linalg.solve"

    def matrix(self, hardness, e, n):
        adjacency = hardness.new_zeros(n, n)
        adjacency[e.receiver, e.sender] = 1.0
        return torch.diag_embed(hardness) + 0.1 * adjacency


class EdgeVectorForces(ZooModel):
    """Energy as a function of the edge vectors only; forces and virial assembled by
    the model from dE/dr_ij (NequIP/SchNetPack "pairwise forces" style)."""

    idiom = "own forces/virial: -dE/dr_ij scattered to both atoms, r_ij x dE/dr_ij"

    def forward(self, batch, compute_stress=False):
        if batch.neighbors is None:
            attach_neighbors(batch, self.cutoff)
        nl = batch.neighbors
        sender, receiver = nl.edge_index
        positions = batch.positions.detach()
        with torch.enable_grad():
            vectors = positions[receiver] + nl.shifts(batch.cell, batch.batch) - positions[sender]
            vectors = vectors.detach().requires_grad_(True)
            d = torch.linalg.norm(vectors, dim=-1)
            envelope = cosine_cutoff(d, self.cutoff)
            rbf = torch.exp(-2.0 * (d[:, None] - self.centers) ** 2) * envelope[:, None]
            e = Edges(sender, receiver, vectors, d, envelope, rbf)
            h = self.embed[batch.atomic_numbers]
            for layer in range(2):
                h = self.interaction(layer, h, e)
            atomic = self.energy(h)
            energy = atomic.new_zeros(batch.num_systems).index_add(0, batch.batch, atomic)
            (d_vectors,) = torch.autograd.grad(energy.sum(), vectors)
        forces = torch.zeros_like(positions)
        forces = forces.index_add(0, sender, d_vectors).index_add(0, receiver, -d_vectors)
        out = {"energy": energy.detach(), "energies": atomic.detach(), "forces": forces}
        if compute_stress:
            edge_system = batch.batch[receiver]
            virial = vectors.new_zeros(batch.num_systems, 3, 3).index_add(
                0, edge_system, vectors.detach()[:, :, None] * d_vectors[:, None, :])
            virial = 0.5 * (virial + virial.transpose(1, 2))
            out["stress"] = virial / torch.linalg.det(batch.cell).abs().view(-1, 1, 1)
        return out


class AllPairsGraph(ZooModel):
    """The model ignores the given list and builds all pairs of atoms itself, with the
    minimum-image convention through the cell."""

    idiom = "own graph: all pairs from meshgrid(arange(n)), minimum image"

    def atomic_energies(self, batch, positions, cell):
        n = positions.shape[0]
        index = torch.arange(n, device=positions.device)
        i, j = torch.meshgrid(index, index, indexing="ij")
        off_diagonal = i != j
        sender, receiver = i[off_diagonal], j[off_diagonal]
        frac = (positions[receiver] - positions[sender]) @ torch.linalg.inv(cell[0])
        frac = frac - torch.round(frac) * batch.pbc[0].to(frac.dtype)
        vectors = frac @ cell[0]
        d = torch.linalg.norm(vectors, dim=-1)
        envelope = cosine_cutoff(d, self.cutoff)
        rbf = torch.exp(-2.0 * (d[:, None] - self.centers) ** 2) * envelope[:, None]
        e = Edges(sender, receiver, vectors, d, envelope, rbf)
        h = self.embed[batch.atomic_numbers]
        for layer in range(2):
            h = self.interaction(layer, h, e)
        return self.energy(h)


GEOMETRY = [SenderTriplets, SenderTripletsByMask, DimeNetTriplets, QEqIndexPut, QEqSetItem, EdgeVectorForces, AllPairsGraph]
