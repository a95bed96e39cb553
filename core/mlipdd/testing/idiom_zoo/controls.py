"""Controls: models written only with what the decomposition plainly supports.

Row-local math, reads by sender index, scatter-adds into receivers, per-system sums.
Each should be exact at every rank count; one that is not points at the harness or
at a regression in the plain path, not at an exotic idiom.
"""

from __future__ import annotations

import torch
from torch import nn

from mlipdd.testing.idiom_zoo._base import TwoLayerZooModel, ZooModel, shifted_softplus


class SchNetLike(ZooModel):
    """Continuous-filter convolutions (Schütt et al.): filter network on the radial basis,
    atom-wise linear layers, shifted softplus, an MLP readout."""

    idiom = "control: SchNet cfconv, index_add into receivers"

    def __init__(self, interactions: int = 2, **kwargs):
        super().__init__(**kwargs)
        f, b = self.features, self.n_basis
        self.embedding = self.seeded(nn.Embedding(119, f))
        self.blocks = nn.ModuleList()
        for _ in range(interactions):
            self.blocks.append(self.seeded(nn.ModuleDict({
                "filter_in": nn.Linear(b, f), "filter_out": nn.Linear(f, f),
                "in2f": nn.Linear(f, f, bias=False), "f2out": nn.Linear(f, f), "dense": nn.Linear(f, f),
            })))
        self.head = self.seeded(nn.Sequential(nn.Linear(f, f // 2), nn.Tanh(), nn.Linear(f // 2, 1)))

    def atomic_energies(self, batch, positions, cell):
        e = self.edges(batch, positions, cell)
        h = self.embedding(batch.atomic_numbers)
        for block in self.blocks:
            w = block["filter_out"](shifted_softplus(block["filter_in"](e.rbf))) * e.envelope[:, None]
            x = block["in2f"](h)
            messages = x[e.sender] * w
            x = torch.zeros_like(x).index_add(0, e.receiver, messages)
            h = h + block["dense"](shifted_softplus(block["f2out"](x)))
        return self.head(h).squeeze(-1)


class PaiNNLike(ZooModel):
    """Scalar and vector features (Schütt et al. 2021): messages split into three gates,
    vector features carried by the edge direction, an update mixing vector norms."""

    idiom = "control: PaiNN scalars + vectors, index_add"

    def __init__(self, interactions: int = 2, **kwargs):
        super().__init__(**kwargs)
        f, b = self.features, self.n_basis
        self.embedding = self.seeded(nn.Embedding(119, f))
        self.phi = nn.ModuleList([self.seeded(nn.Sequential(nn.Linear(f, f), nn.SiLU(), nn.Linear(f, 3 * f)))
                                  for _ in range(interactions)])
        self.w = nn.ModuleList([self.seeded(nn.Linear(b, 3 * f)) for _ in range(interactions)])
        self.uv = nn.ModuleList([self.seeded(nn.Linear(f, 2 * f, bias=False)) for _ in range(interactions)])
        self.update = nn.ModuleList([self.seeded(nn.Sequential(nn.Linear(2 * f, f), nn.SiLU(), nn.Linear(f, 3 * f)))
                                     for _ in range(interactions)])
        self.head = self.seeded(nn.Sequential(nn.Linear(f, f), nn.SiLU(), nn.Linear(f, 1)))

    def atomic_energies(self, batch, positions, cell):
        e = self.edges(batch, positions, cell)
        f = self.features
        unit = e.vectors / e.distance[:, None]
        s = self.embedding(batch.atomic_numbers)
        v = torch.zeros(s.shape[0], 3, f, dtype=s.dtype, device=s.device)
        for phi, w, uv, update in zip(self.phi, self.w, self.uv, self.update):
            x = phi(s)[e.sender] * w(e.rbf) * e.envelope[:, None]
            ds, dvv, dvs = torch.split(x, f, dim=-1)
            dv = dvv[:, None, :] * v[e.sender] + dvs[:, None, :] * unit[:, :, None]
            s = s + torch.zeros_like(s).index_add(0, e.receiver, ds)
            v = v + torch.zeros_like(v).index_add(0, e.receiver, dv)
            uv_out = uv(v)
            u_v, v_v = torch.split(uv_out, f, dim=-1)
            a = update(torch.cat([s, torch.sqrt((v_v**2).sum(1) + 1e-8)], dim=-1))
            a_vv, a_sv, a_ss = torch.split(a, f, dim=-1)
            v = v + a_vv[:, None, :] * u_v
            s = s + a_sv * (u_v * v_v).sum(1) + a_ss
        return self.head(s).squeeze(-1)


class LayerNormFeatures(TwoLayerZooModel):
    """nn.LayerNorm over each atom's features (row-local, unlike a norm over atoms)."""

    idiom = "control: nn.LayerNorm over features"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = self.seeded(nn.LayerNorm(self.features))

    def idiom_step(self, h, e, batch, positions, cell):
        return self.norm(h)


class SpeciesNetworks(ZooModel):
    """TorchANI-style: one atomic network per element, applied to the atoms of that
    element found by ``torch.unique`` and a mask, written back by masked assignment."""

    idiom = "control: per-element networks over unique(species) masks (TorchANI)"

    def __init__(self, species=(1, 8), **kwargs):
        super().__init__(**kwargs)
        f = self.features
        self.networks = nn.ModuleDict({str(z): self.seeded(nn.Sequential(nn.Linear(f, f), nn.CELU(0.1),
                                                                         nn.Linear(f, 1)))
                                       for z in species})

    def atomic_energies(self, batch, positions, cell):
        e = self.edges(batch, positions, cell)
        h = self.interaction(0, self.embed[batch.atomic_numbers], e)
        h = self.interaction(1, h, e)
        out = h.new_zeros(h.shape[0])
        z = batch.atomic_numbers
        for element in torch.unique(z).tolist():
            mask = z == element
            out[mask] = self.networks[str(element)](h[mask]).squeeze(-1)
        return out


class PermutedFeatureSum(TwoLayerZooModel):
    """``h.permute(1, 0).sum(0)``: a sum at dim 0 that is over the FEATURES (the atoms
    moved to dim 1), so row-local; a sum over atoms must not be assumed from ``dim=0``."""

    idiom = "control: permute(1, 0).sum(0) sums features, not atoms"

    def idiom_step(self, h, e, batch, positions, cell):
        per_atom = h.permute(1, 0).sum(0)
        return h * torch.sigmoid(per_atom)[:, None]


class StackedLayerReadouts(ZooModel):
    """NequIP/MACE-style: a readout after every layer, ``torch.stack`` over the layers and
    a sum over the layer dimension."""

    idiom = "control: torch.stack(per-layer readouts).sum(0) over layers"

    def __init__(self, **kwargs):
        super().__init__(layers=3, **kwargs)
        self.heads = nn.ParameterList([self.weight(self.features) for _ in range(3)])

    def atomic_energies(self, batch, positions, cell):
        e = self.edges(batch, positions, cell)
        h = self.embed[batch.atomic_numbers]
        readouts = []
        for layer, head in enumerate(self.heads):
            h = self.interaction(layer, h, e)
            readouts.append(h @ head)
        return torch.stack(readouts, dim=0).sum(0)


CONTROLS = [SchNetLike, PaiNNLike, LayerNormFeatures, SpeciesNetworks, PermutedFeatureSum, StackedLayerReadouts]
