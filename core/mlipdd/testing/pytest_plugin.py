"""pytest plugin (entry point ``pytest11``): options and markers for the conformance kit.

Any model plugin, ours or a third party's, gets the single-process vs spawned-ranks
checks with two lines in its own tests::

    from mlipdd.testing import conformance_suite
    test_conformance = conformance_suite(my_model_factory, species=(1, 6, 8))

Rank counts: each suite states its own (``world_sizes=``, default 2, 3, 4);
``pytest --mlipdd-world-sizes=2,3,4`` overrides them for every suite in the run (e.g. a
quick local run at 2 ranks, the full matrix in CI).
"""

from __future__ import annotations

import pytest

CONFORMANCE_MARKER = "mlipdd_conformance"


def pytest_addoption(parser):
    group = parser.getgroup("mlipdd")
    group.addoption(
        "--mlipdd-world-sizes",
        default=None,
        help="rank counts every mlipdd conformance suite spawns, comma separated (e.g. 2,3,4); "
             "default: each suite's own world_sizes",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{CONFORMANCE_MARKER}(world_sizes): single process vs spawned ranks (mlipdd)"
    )
    config.addinivalue_line("markers", "slow: longer runs (deselect with -m 'not slow')")


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``"2,3,4"`` -> ``(2, 3, 4)``; anything else is a usage error naming the fix."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(
            f"--mlipdd-world-sizes={text!r} is not a list of rank counts; write e.g. --mlipdd-world-sizes=2,3,4"
        )
    return sizes


def pytest_generate_tests(metafunc):
    """A conformance suite's ``world_size``: the command line's, else the suite's own."""
    marker = metafunc.definition.get_closest_marker(CONFORMANCE_MARKER)
    if marker is None or "world_size" not in metafunc.fixturenames:
        return
    given = metafunc.config.getoption("mlipdd_world_sizes")
    sizes = parse_world_sizes(given) if given else tuple(marker.kwargs["world_sizes"])
    metafunc.parametrize("world_size", sizes)
