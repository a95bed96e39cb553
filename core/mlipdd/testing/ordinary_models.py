"""Two message-passing potentials written the ordinary single-process way.

Conformance models for sharded storage (and any strategy): per-atom state starts as
``torch.zeros(n_atoms, ...)`` (``n_atoms = batch.num_atoms``; also ``torch.empty``,
``torch.full`` and ``new_zeros`` of a parameter), is filled in place,
read by sender index (``state[sender]``) and accumulated with in-place ``index_add_``
(rebound, ``x = x.index_add_(...)``). Nothing in them knows about ranks.

* `VectorMPNN`: scalar and vector (l=1) features per atom; messages carry the edge
  direction, and the energy reads the squared norms of the vector features, so it is
  rotation invariant and its forces are not a sum of pair terms.
* `ChargeMPNN`: charges ``q = torch.full((n_atoms,), 0.0)`` that every layer reads by sender
  and re-equilibrates under a per-system total charge (two per-system sums per layer,
  a Lagrange multiplier per system read back per atom), plus a damped Coulomb-like
  pair energy.
* `WholeSystemMPNN`: one system written with whole-tensor reductions over the atoms
  (``q - q.mean()`` for neutral charges, ``(q * q).sum()`` fed back into every atom, a
  softmax over all atoms shifted by ``chi.max()``, ``features.abs().amax()``, products
  over the atoms ``q @ x``, ``torch.dot``, ``x.T @ x``, ``einsum("n,nk,k->")``,
  ``softmax(dim=0)``, ``logsumexp``, ``std``, ``var`` and ``vector_norm`` over the atoms),
  as a single-system model is often written.
* `DegreeMPNN`: messages summed with ``index_put_(..., accumulate=True)`` and divided by
  the out-degree of each atom within the cutoff (an ``index_add_`` of ones by sender);
  its first layer (whose ghost rows the second reads) can instead average its messages
  with ``scatter_reduce(..., "mean")`` (``first_layer="mean"``) or ``index_reduce``
  (``"index_mean"``, ``"index_amax"``), which count every listed edge, so the result
  depends on the list's skin: compare them at skin 0; or sum them as a sparse adjacency
  matrix times the features (``first_layer="sparse"``).
* `EinsumMPNN`: every product spelled with ``torch.einsum``: three operands per edge, an
  outer product per edge, rows kept (``"nf,fg->ng"``), rows summed (a Gram matrix
  ``"nf,ng->fg"``), the implicit output of ``"nf,f"``, an ellipsis; a rank owning one atom holds
  rows of size 1, which torch's einsum takes for a broadcast dim (NOTE [a single row]).
"""

from __future__ import annotations

import torch
from torch import nn

from mlipdd.data import Batch
from mlipdd.models.base import ModelConfig, ModelWrapper, NeighborConfig
from mlipdd.testing.toy_models import cosine_envelope, species_rows, species_table

__all__ = ["ChargeMPNN", "DegreeMPNN", "EinsumMPNN", "VectorMPNN", "WholeSystemMPNN"]


class _OrdinaryMPNN(ModelWrapper):
    """Shared setup: species table, radial basis, edges of the neighbour list."""

    def __init__(self, cutoff: float, features: int, n_basis: int, species, seed: int, dtype):
        super().__init__()
        self.model_config = ModelConfig(NeighborConfig(cutoff))
        self.generator = torch.Generator().manual_seed(seed)
        self.features, self.dtype = features, dtype
        self.register_buffer("species_index", species_table(species))
        self.register_buffer("centers", torch.linspace(0.5, cutoff, n_basis, dtype=dtype))
        self.embed = self._weight(len(species), features, scale=0.5)

    def _weight(self, *shape, scale: float | None = None) -> nn.Parameter:
        scale = 1.0 / shape[0] if scale is None else scale
        return nn.Parameter(torch.randn(*shape, generator=self.generator, dtype=self.dtype) * scale)

    def _edges(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor):
        nl = batch.neighbors
        sender, receiver = nl.edge_index
        vectors = positions[receiver] + nl.shifts(cell, batch.batch) - positions[sender]
        d = vectors.norm(dim=1)
        envelope = cosine_envelope(d, self.cutoff)
        basis = torch.exp(-2.0 * (d.unsqueeze(1) - self.centers) ** 2) * envelope.unsqueeze(1)
        return sender, receiver, vectors / d.unsqueeze(1), d, envelope, basis


class VectorMPNN(_OrdinaryMPNN):
    def __init__(self, cutoff: float = 4.0, features: int = 8, layers: int = 2, n_basis: int = 8,
                 species=(1, 8, 18), seed: int = 0, dtype=torch.float64, int_sizes: bool = False):
        super().__init__(cutoff, features, n_basis, species, seed, dtype)
        # int(n_atoms) drops the row layout: reproduces the one case sharded storage cannot
        # infer, for the error tests
        self.int_sizes = int_sizes
        self.scalar_radial = nn.ParameterList([self._weight(n_basis, features) for _ in range(layers)])
        self.vector_radial = nn.ParameterList([self._weight(n_basis, features) for _ in range(layers)])
        self.update = nn.ParameterList([self._weight(features, features) for _ in range(layers)])
        self.mix = nn.ParameterList([self._weight(features, features) for _ in range(layers)])
        self.readout = self._weight(features)

    def atomic_energies(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        sender, receiver, unit, _, _, basis = self._edges(batch, positions, cell)
        n_atoms = int(batch.num_atoms) if self.int_sizes else batch.num_atoms
        scalars = torch.zeros(n_atoms, self.features, dtype=positions.dtype, device=positions.device)
        scalars[:] = self.embed[species_rows(self, batch.atomic_numbers)]
        vectors = self.embed.new_zeros((n_atoms, self.features, 3))
        for scalar_radial, vector_radial, update, mix in zip(
            self.scalar_radial, self.vector_radial, self.update, self.mix
        ):
            s_j, v_j = scalars[sender], vectors[sender]
            gate = basis @ scalar_radial
            scalar_messages = gate * s_j
            vector_messages = (gate * s_j).unsqueeze(2) * unit.unsqueeze(1) \
                + (basis @ vector_radial).unsqueeze(2) * v_j
            d_scalars = torch.zeros(n_atoms, self.features, dtype=positions.dtype, device=positions.device)
            d_scalars = d_scalars.index_add_(0, receiver, scalar_messages)
            d_vectors = torch.empty(n_atoms, self.features, 3, dtype=positions.dtype, device=positions.device)
            d_vectors = d_vectors.fill_(0.0).index_add_(0, receiver, vector_messages)
            scalars = scalars + torch.tanh(d_scalars @ update) + torch.tanh((d_vectors * d_vectors).sum(2) @ mix)
            vectors = vectors + d_vectors
        return scalars @ self.readout


class ChargeMPNN(_OrdinaryMPNN):
    def __init__(self, cutoff: float = 4.5, features: int = 8, layers: int = 2, n_basis: int = 8,
                 species=(1, 8), seed: int = 1, damping: float = 1.2, coulomb_scale: float = 0.02,
                 dtype=torch.float64):
        super().__init__(cutoff, features, n_basis, species, seed, dtype)
        self.radial = nn.ParameterList([self._weight(n_basis, features) for _ in range(layers)])
        self.update = nn.ParameterList([self._weight(features, features) for _ in range(layers)])
        self.charge_coupling = nn.ParameterList([self._weight(features) for _ in range(layers)])
        self.chi_head = self._weight(features)
        self.hardness_head = self._weight(features)
        self.readout = self._weight(features)
        self.damping, self.coulomb_scale = damping, coulomb_scale

    def atomic_energies(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        sender, receiver, _, d, envelope, basis = self._edges(batch, positions, cell)
        n_atoms, n_systems = batch.num_atoms, batch.num_systems
        like = {"dtype": positions.dtype, "device": positions.device}
        total_charge = batch.charge.reshape(-1) if batch.charge is not None else torch.zeros(n_systems, **like)
        features = self.embed[species_rows(self, batch.atomic_numbers)]
        charges = torch.full((n_atoms,), 0.0, **like)
        for radial, update, coupling in zip(self.radial, self.update, self.charge_coupling):
            messages = (basis @ radial) * features[sender] * (1.0 + charges[sender].unsqueeze(1) * coupling)
            aggregated = torch.zeros(n_atoms, self.features, **like)
            aggregated = aggregated.index_add_(0, receiver, messages)
            features = features + torch.tanh(aggregated @ update)
            chi = features @ self.chi_head
            hardness = nn.functional.softplus(features @ self.hardness_head) + 1.0
            # equilibrate: q_i = (lam - chi_i) / J_i with one multiplier per system
            inverse_sum = torch.zeros(n_systems, **like).index_add(0, batch.batch, 1.0 / hardness)
            weighted_sum = torch.zeros(n_systems, **like).index_add(0, batch.batch, chi / hardness)
            lam = (total_charge + weighted_sum) / inverse_sum
            charges = (lam[batch.batch] - chi) / hardness
        safe_d = torch.where(envelope > 0, d, torch.ones_like(d))
        pair = torch.erf(safe_d / self.damping) / safe_d * envelope
        coulomb = self.readout.new_zeros(n_atoms)
        coulomb = coulomb.index_add_(0, receiver, 0.5 * self.coulomb_scale * charges[receiver] * charges[sender] * pair)
        return features @ self.readout + chi * charges + 0.5 * hardness * charges**2 + coulomb


class WholeSystemMPNN(_OrdinaryMPNN):
    def __init__(self, cutoff: float = 4.5, features: int = 8, n_basis: int = 8, species=(1, 8),
                 seed: int = 2, dtype=torch.float64):
        super().__init__(cutoff, features, n_basis, species, seed, dtype)
        self.radial = self._weight(n_basis, features)
        self.update = self._weight(features, features)
        self.charge_head = self._weight(features)
        self.attention_head = self._weight(features)
        self.readout = self._weight(features)

    def atomic_energies(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        sender, receiver, _, _d, _envelope, basis = self._edges(batch, positions, cell)
        n_atoms = batch.num_atoms
        features = self.embed[species_rows(self, batch.atomic_numbers)]
        aggregated = torch.zeros(n_atoms, self.features, dtype=positions.dtype, device=positions.device)
        aggregated = aggregated.index_add_(0, receiver, (basis @ self.radial) * features[sender])
        features = features + torch.tanh(aggregated @ self.update)
        features = features / (1.0 + features.abs().amax())
        raw = features @ self.charge_head
        charges = raw - raw.mean()  # the system is neutral
        features = features * (1.0 + 0.1 * torch.tanh((charges * charges).sum()))
        chi = features @ self.attention_head
        weights = torch.exp(chi - chi.max())
        weights = weights / weights.sum()  # attention over every atom of the system
        pooled = (weights.unsqueeze(1) * features).sum(0)
        polarity = charges @ features  # (features,): a contraction over the atoms
        coupling = torch.dot(charges, raw) + (features.T @ features).trace()
        projection = torch.einsum("n,nk,k->", charges, features, self.readout)
        # the same pooling by library calls, and spreads over all atoms
        attention = torch.nn.functional.softmax(chi, dim=0)
        spread = raw.std() + features.var(dim=0).sum() + torch.linalg.vector_norm(charges)
        free_energy = torch.logsumexp(chi, dim=0) + torch.log_softmax(chi, 0).mean()
        return (features @ self.readout + 0.5 * charges**2 + 0.05 * features @ (pooled + polarity)
                + 0.01 * chi.amax() + 1e-3 * torch.tanh(coupling) + 0.01 * projection
                + 0.1 * attention * chi + 0.01 * (spread + free_energy))


class DegreeMPNN(_OrdinaryMPNN):
    def __init__(self, cutoff: float = 4.5, features: int = 8, layers: int = 2, n_basis: int = 8,
                 species=(1, 8), seed: int = 3, dtype=torch.float64, first_layer: str = "sum"):
        super().__init__(cutoff, features, n_basis, species, seed, dtype)
        self.first_layer = first_layer
        self.radial = nn.ParameterList([self._weight(n_basis, features) for _ in range(layers)])
        self.update = nn.ParameterList([self._weight(features, features) for _ in range(layers)])
        self.readout = self._weight(features)

    def atomic_energies(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        sender, receiver, _, d, _, basis = self._edges(batch, positions, cell)
        n_atoms = batch.num_atoms
        features = self.embed[species_rows(self, batch.atomic_numbers)]
        # how many neighbours each atom sends to (the list's skin edges are not neighbours)
        out_degree = torch.zeros(n_atoms, dtype=positions.dtype, device=positions.device)
        out_degree = out_degree.index_add_(0, sender, (d < self.cutoff).to(positions.dtype)).clamp(min=1)
        for layer, (radial, update) in enumerate(zip(self.radial, self.update)):
            messages = (basis @ radial) * features[sender]
            if layer == 0 and self.first_layer == "mean":
                slots = receiver.unsqueeze(1).expand(-1, self.features)
                aggregated = features.scatter_reduce(0, slots, messages, "mean")  # the atom's own row counts too
            elif layer == 0 and self.first_layer in ("index_mean", "index_amax"):
                start = torch.zeros(n_atoms, self.features, dtype=positions.dtype, device=positions.device)
                reduce = self.first_layer.removeprefix("index_")
                aggregated = start.index_reduce(0, receiver, messages, reduce, include_self=False)
            elif layer == 0 and self.first_layer == "sparse":
                weights = (basis @ radial).mean(1)
                adjacency = torch.sparse_coo_tensor(torch.stack([receiver, sender]), weights, (n_atoms, n_atoms))
                aggregated = torch.sparse.mm(adjacency, features)
            else:
                summed = torch.zeros(n_atoms, self.features, dtype=positions.dtype, device=positions.device)
                summed = summed.index_put_((receiver,), messages, accumulate=True)
                aggregated = summed / out_degree.unsqueeze(1)
            features = features + torch.tanh(aggregated @ update)
        return features @ self.readout


class EinsumMPNN(_OrdinaryMPNN):
    def __init__(self, cutoff: float = 4.5, features: int = 6, n_basis: int = 8, species=(1, 8),
                 seed: int = 4, dtype=torch.float64):
        super().__init__(cutoff, features, n_basis, species, seed, dtype)
        self.radial = self._weight(n_basis, features)
        self.update = self._weight(features, features)
        self.readout = self._weight(features)

    def atomic_energies(self, batch: Batch, positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        sender, receiver, unit, _d, _envelope, basis = self._edges(batch, positions, cell)
        n_atoms, f = batch.num_atoms, self.features
        features = self.embed[species_rows(self, batch.atomic_numbers)]
        messages = torch.einsum("eb,bf,ef->ef", basis, self.radial, features[sender])
        aggregated = torch.zeros(n_atoms, f, dtype=positions.dtype, device=positions.device)
        aggregated = aggregated.index_add_(0, receiver, messages)
        vectors = torch.zeros(n_atoms, 3, f, dtype=positions.dtype, device=positions.device)
        vectors = vectors.index_add_(0, receiver, torch.einsum("ec,ef->ecf", unit, messages))
        features = features + torch.tanh(torch.einsum("nf,fg->ng", aggregated, self.update))
        invariant = torch.einsum("ncf,ncf->nf", vectors, vectors)
        gram = torch.einsum("nf,ng->fg", features, features)  # a sum over the atoms
        pooled = torch.einsum("...f,fg->...g", features, torch.tanh(gram))
        total = torch.einsum("nf,f", features * features, self.readout).sum()  # implicit output: "n"
        return (torch.einsum("nf,f->n", features + 0.1 * invariant, self.readout)
                + 0.01 * torch.einsum("ng,g->n", pooled, self.readout) + 1e-3 * torch.tanh(total))
