"""The `slow` tier of this repository's tests, one mechanism for tests/ and plugins/*/tests.

Loaded with ``-p mlipdd.testing.slow_tier`` from the ``addopts`` of the root pyproject.toml
and of each plugin's (a plugin's tests run alone, as tox runs them, take the plugin's
pyproject as their configuration, so a root conftest.py would not reach them). Not part of
the conformance kit's pytest plugin: another project's ``slow`` marker means what it says.

A test marked ``@pytest.mark.slow`` is collected always (so ``pytest --collect-only`` and
``-m slow`` list it) and skipped unless ``MLIPDD_SLOW_TESTS=1`` is set, which ``make
test-full`` does; ``make test`` (CI) runs the rest. A test goes to this tier only when what it
checks is also checked, at the same rank counts, by a cheaper test of the default suite (or,
like the fresh-venv install, by nothing else at all and minutes long); the README's
Development section lists what each target runs.
"""

from __future__ import annotations

import os

SLOW_TESTS = "MLIPDD_SLOW_TESTS"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"slow: the slow tier, skipped unless {SLOW_TESTS}=1 (`make test-full`)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get(SLOW_TESTS, "") not in ("", "0"):
        return
    import pytest  # lazily: the library imports without pytest (tests/test_no_pytest_at_import.py)

    skip = pytest.mark.skip(reason=f"slow tier: `make test-full` ({SLOW_TESTS}=1) runs it")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
