"""`conformance_suite`: a parametrised pytest test for any model factory."""

from __future__ import annotations

from collections.abc import Callable

from mlipdd.testing.conformance import check_conformance_cases, relative_difference
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

    One launch per rank count runs every cell (`check_conformance_cases`: each rank and
    the reference build the model once), when the first cell's test asks for it; each
    cell's test then checks its own result. A launch that fails fails every cell of that
    rank count with its error (it is not run again). A run selecting one cell (``-k``)
    still pays for all cells of its rank count.
    """
    # pytest is imported here, not at module level: `mlipdd.testing` (systems, spawn,
    # conformance) serves `mlipdd validate` on machines without pytest.
    import pytest

    limits = {**DEFAULT_TOLERANCES, **(tolerances or {})}
    checked: dict[int, dict | BaseException] = {}

    def cells_at(world_size: int) -> dict:
        if world_size not in checked:
            batches = {}
            for cell in cells:
                batch = AWKWARD_CELLS[cell](species=species, spacing=spacing)
                batches[cell] = batch if batch_transform is None else batch_transform(batch)
            cases = [(model_factory, batch, config_kwargs or {}) for batch in batches.values()]
            try:
                results = check_conformance_cases(cases, world_size, compute_stress=compute_stress,
                                                  timeout=600.0)
            except Exception as error:  # noqa: BLE001 - raised again by each cell's test
                checked[world_size] = error
            else:
                checked[world_size] = dict(zip(batches, results, strict=True))
        if isinstance(checked[world_size], BaseException):
            raise checked[world_size]
        return checked[world_size]

    @pytest.mark.mlipdd_conformance(world_sizes=tuple(world_sizes))
    @pytest.mark.parametrize("cell", cells)
    def test_conformance(cell, world_size):
        result, parts = cells_at(world_size)[cell]
        for part in parts[1:]:  # the replicated energy agrees across ranks
            assert relative_difference(part["energy"], parts[0]["energy"]) < 1e-14, (cell, world_size)
        result.assert_close(**limits)

    return test_conformance
