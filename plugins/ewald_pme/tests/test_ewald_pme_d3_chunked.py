"""D3's C6 sums in chunks of edges (NOTE [chunked D3 pairs]) equal one chunk of all edges at one
process, float64 1e-12: energy, forces and stress of a dense ionic crystal (the stable weights'
fallback), a metal, an oxide slab and a molecule, two-body and with the three-body ATM term and
a switched cutoff (which reads the same C6). At 2, 3 and 4 ranks: test_ewald_pme_distributed
(chunked ranks against an unchunked process), test_ewald_pme_sharded, test_ewald_pme_aten.
"""

from __future__ import annotations

import pytest
from mlipdd import Batch
from mlipdd.data import InputError
from mlipdd_ewald_pme.d3 import D3Wrapper
from mlipdd_ewald_pme.testing import d3_systems

SYSTEMS = ("MgO rock salt", "Cu fcc (cubic)", "MgO(100) slab", "benzene")


@pytest.fixture(scope="module")
def batches():
    systems = d3_systems()
    return {name: Batch.from_ase(systems[name]) for name in SYSTEMS}


@pytest.mark.parametrize("params", [{}, {"s9": 1.0}], ids=["two-body", "ATM"])
def test_chunked_equals_one_block(batches, params):
    for name, batch in batches.items():
        whole = D3Wrapper(cutoff=6.0, params=params, switch_on=4.5, chunk=10**9)(batch, compute_stress=True)
        for chunk in (7,):
            part = D3Wrapper(cutoff=6.0, params=params, switch_on=4.5, chunk=chunk)(batch, compute_stress=True)
            for key in ("energy", "forces", "stress"):
                scale = whole[key].abs().max().clamp_min(1e-30)
                diff = float((part[key] - whole[key]).abs().max() / scale)
                assert diff <= 1e-12, f"{name}, chunk {chunk}: {key} differs by {diff:.1e}"


def test_chunk_must_be_positive():
    with pytest.raises(InputError, match="chunk"):
        D3Wrapper(chunk=0)
