"""cuEquivariance MACE under the aten dispatch equals one process.

Every cuEq layer's polynomial (and layout transpose) is one adapted call while a distributed
forward runs (NOTE [cuEq kernels under aten] in `mlipdd_mace.cueq_aten`), whatever its kernel:
on CPU cuequivariance-torch's torch reference code, on a GPU the CUDA op the aten rules cannot
see into (`benchmarks/cueq_dd_gpu.py` checks that one on the H200). mace's unfused convolution
and the fused form (`reference_fused_cueq_wrapper`, mace's calling convention on the reference
kernels), halo and sharded storage, float64, 2/3/4 gloo ranks in one launch per rank count: a
triclinic cell, a cell whose ranks see their own images and a slab; energy, forces and stress
to 1e-10.
"""

from __future__ import annotations

import functools

import pytest

from mlipdd.testing.conformance import check_conformance_cases
from mlipdd_mace.testing import (
    SMALL_CUEQ_ARCH,
    cueq_mace_wrapper,
    reference_fused_cueq_wrapper,
    small_cueq_systems,
)

STORAGES = ({"strategy": "halo", "skin": 0.0}, {"strategy": "sharded", "skin": 0.0})
FORMS = {"unfused": functools.partial(cueq_mace_wrapper, **SMALL_CUEQ_ARCH),
         "fused": functools.partial(reference_fused_cueq_wrapper, **SMALL_CUEQ_ARCH)}


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_cueq_exact_under_aten_dispatch(world_size):
    systems = small_cueq_systems()
    cases = [(factory, batch, storage) for factory in FORMS.values() for batch in systems.values()
             for storage in STORAGES]
    labels = [(form, name, storage["strategy"]) for form in FORMS for name in systems for storage in STORAGES]
    for label, (result, _) in zip(labels, check_conformance_cases(cases, world_size, timeout=900)):
        for key, limit in (("energy", 1e-10), ("forces", 1e-10), ("stress", 1e-10)):
            assert result.rel_diff[key] < limit, (world_size, label, result.rel_diff)
