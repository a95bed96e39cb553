"""pytest plugin (entry point ``pytest11``): options and markers for the conformance kit.

Any model plugin, ours or a third party's, gets the single-process vs spawned-ranks
checks with two lines in its own tests::

    from mlipdd.testing import conformance_suite
    test_conformance = conformance_suite(my_model_factory, species=(1, 6, 8))
"""

from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("mlipdd")
    group.addoption(
        "--mlipdd-world-sizes",
        default="2,3,4",
        help="rank counts the mlipdd conformance suite spawns (comma separated, default 2,3,4)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "mlipdd_conformance: single process vs spawned ranks (mlipdd)")
    config.addinivalue_line("markers", "slow: longer runs (deselect with -m 'not slow')")
