"""`conformance_suite`: a parametrised pytest test for any model factory."""

from __future__ import annotations

from collections.abc import Callable

from mlipdd.testing.conformance import check_conformance
from mlipdd.testing.systems import AWKWARD_CELLS

DEFAULT_TOLERANCES = {"energy": 1e-12, "forces": 1e-10, "stress": 1e-10}


def conformance_suite(model_factory: Callable, species=(18,), spacing: float = 3.7,
                      world_sizes=(2, 3, 4), cells=tuple(AWKWARD_CELLS), tolerances: dict | None = None,
                      compute_stress: bool = True, batch_transform: Callable | None = None,
                      config_kwargs: dict | None = None):
    """A test over ``cells`` x ``world_sizes`` comparing spawned ranks to one process.

    ``model_factory`` must be a module-level callable (it is sent to the ranks).
    ``batch_transform`` adapts a built system (e.g. a dtype change) before the check.
    ``config_kwargs`` go to each rank's `DomainConfig` (e.g. ``{"strategy": "sharded"}``).
    ``pytest --mlipdd-world-sizes=...`` overrides ``world_sizes`` for the run (the
    kit's pytest plugin parametrises ``world_size``).
    """
    # pytest is imported here, not at module level: `mlipdd.testing` (systems, spawn,
    # conformance) serves `mlipdd validate` on machines without pytest.
    import pytest

    limits = {**DEFAULT_TOLERANCES, **(tolerances or {})}

    @pytest.mark.mlipdd_conformance(world_sizes=tuple(world_sizes))
    @pytest.mark.parametrize("cell", cells)
    def test_conformance(cell, world_size):
        batch = AWKWARD_CELLS[cell](species=species, spacing=spacing)
        if batch_transform is not None:
            batch = batch_transform(batch)
        result = check_conformance(model_factory, batch, world_size, compute_stress=compute_stress,
                                   config_kwargs=config_kwargs)
        result.assert_close(**limits)

    return test_conformance
