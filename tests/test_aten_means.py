"""Means, variances, softmax and logsumexp over the rows under the aten dispatch (NOTE [aten means]).

`WholeSystemMPNN` (``q - q.mean()``, ``std``, ``var(dim=0)``, ``softmax(dim=0)``, ``logsumexp``,
``log_softmax(..).mean()``, ``vector @ matrix`` over the atoms) at 2/3/4 gloo ranks, halo and
sharded storage, float64: energy, forces and stress to 1e-10 relative.

At 4 ranks the small cell under sharded storage gives ranks 12 and 6 owned atoms: opt_einsum
and multi_dot order a 3-operand product by those LOCAL sizes, so without NOTE [contraction
order] the ranks all_reduce different partials and hang (`ChainedProducts` adds multi_dot and
chain_matmul to the einsum WholeSystemMPNN already has).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from mlipdd.testing.conformance import check_conformance_cases
from mlipdd.testing.ordinary_models import WholeSystemMPNN
from mlipdd.testing.systems import small_cell, triclinic


class ChainedProducts(WholeSystemMPNN):
    """Products of three factors over the atoms, whose order torch picks from the shapes."""

    def atomic_energies(self, batch, positions, cell):
        energies = super().atomic_energies(batch, positions, cell)
        h = torch.tanh(energies).unsqueeze(1) * self.update[0]  # (atoms, features)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # chain_matmul is deprecated, not gone
            gram = torch.chain_matmul(h.T, h, self.update)
        chained = torch.linalg.multi_dot([energies, h, self.readout]) + gram.trace()
        return energies + 1e-3 * torch.tanh(chained)


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_whole_system_reductions_exact_under_aten(world_size):
    cases = [(model, batch, {"strategy": strategy})
             for model in (WholeSystemMPNN, ChainedProducts)
             for strategy in ("halo", "sharded")
             for batch in (triclinic(species=(1, 8), spacing=3.0, reps=4),
                           small_cell(species=(1, 8), spacing=2.6, reps=3))]
    for result, _ in check_conformance_cases(cases, world_size):
        result.assert_close(energy=1e-10)
