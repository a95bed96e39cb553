"""Slab (dipole) correction for Ewald and PME (issue 26 item 6): a tilted, rattled NaCl slab
with random charges (a dipole across it; neutral, and charged) in cells with vacuum along
a non-periodic third axis. The corrected energy and forces reach the large-vacuum limit
(400 A of vacuum) within 1e-5 at 20 A and to ~1e-9 at 40 A, where the uncorrected 3D sum is
still 3 % off and closes in only as 1 / vacuum; PME equals it to its accuracy. Bad
combinations are refused with the fix.
"""

from __future__ import annotations

import pytest
import torch
from mlipdd.data import InputError
from mlipdd_ewald_pme.testing import dipolar_slab as slab
from mlipdd_ewald_pme.wrappers import EwaldWrapper, PMEWrapper


def _rel(a, b) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def _ewald(**options):
    return EwaldWrapper(cutoff=8.0, accuracy=1e-8, **options)


@pytest.mark.parametrize("neutral", [True, False])
def test_corrected_ewald_reaches_the_large_vacuum_limit(neutral):
    limit = _ewald(slab_correction=True)(slab(400.0, neutral))
    for vacuum, tolerance in ((20.0, 1e-5), (40.0, 1e-8)):
        out = _ewald(slab_correction=True)(slab(vacuum, neutral))
        assert _rel(out["energy"], limit["energy"]) < tolerance, vacuum
        assert _rel(out["forces"], limit["forces"]) < tolerance, vacuum


def test_uncorrected_sum_closes_in_only_as_one_over_the_vacuum():
    limit = _ewald(slab_correction=True)(slab(400.0))
    errors = [_rel(_ewald()(slab(v, periodic=True))["forces"], limit["forces"]) for v in (40.0, 80.0)]
    assert errors[0] > 1e-2  # the dipole's images: what the correction removes
    assert 1.6 < errors[0] / errors[1] < 2.4, errors  # ~1 / L towards the same limit


def test_corrected_pme_equals_corrected_ewald():
    for vacuum in (20.0, 40.0):
        batch = slab(vacuum)
        ewald = _ewald(slab_correction=True)(batch, compute_stress=True)
        pme = PMEWrapper(cutoff=8.0, accuracy=1e-6, slab_correction=True)(batch, compute_stress=True)
        assert _rel(pme["energy"], ewald["energy"]) < 1e-6
        assert _rel(pme["forces"], ewald["forces"]) < 1e-5
        assert _rel(pme["stress"], ewald["stress"]) < 1e-5


def test_slab_options_are_refused_where_they_do_not_fit():
    with pytest.raises(InputError, match="slab_correction=True"):
        EwaldWrapper(cutoff=6.0)(slab(20.0))
    with pytest.raises(InputError, match="needs a slab"):
        PMEWrapper(cutoff=6.0, slab_correction=True)(slab(20.0, periodic=True))
    two_open = slab(20.0)
    two_open.system["pbc"] = torch.tensor([[True, False, False]])
    with pytest.raises(InputError, match="use DSFWrapper"):
        EwaldWrapper(cutoff=6.0, slab_correction=True)(two_open)
