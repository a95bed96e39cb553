"""D3Wrapper on float32 inputs (its reference tables are float64): the float32 result is
the float64 one to float32 rounding, pair and three-body terms, energy, forces, stress."""

from __future__ import annotations

import pytest
import torch
from mlipdd_ewald_pme import D3Wrapper
from mlipdd_ewald_pme.testing import rock_salt


@pytest.mark.parametrize("options", [{}, {"params": {"s9": 1.0}, "three_body_cutoff": 5.0}], ids=["pairs", "atm"])
def test_d3_float32_equals_float64(options):
    batch = rock_salt((2, 2, 2), seed=3)
    reference = D3Wrapper(cutoff=8.0, **options)(batch, compute_stress=True)
    single = batch.clone()
    single.node["positions"] = batch.positions.float()
    single.system["cell"] = batch.cell.float()
    out = D3Wrapper(cutoff=8.0, **options)(single, compute_stress=True)
    for key in ("energy", "forces", "stress"):
        assert out[key].dtype == torch.float32
        diff = float((out[key].detach().double() - reference[key].detach()).abs().max() / reference[key].detach().abs().max())
        assert diff < 2e-5, f"{key}: float32 differs from float64 by {diff:.2e}"
