"""The conformance kit's pytest option: ``--mlipdd-world-sizes`` sets the rank counts of
every `conformance_suite`; without it each suite keeps its own. Collection only (the
suites themselves run in the plugins' tests), except one launch of 2 ranks showing that a
wrong model fails every cell of a suite."""

pytest_plugins = ["pytester"]

SUITE = '''
from mlipdd.testing import conformance_suite
from mlipdd.testing.toy_models import ToyMPNN

test_toy = conformance_suite(ToyMPNN, world_sizes=(2,), cells=("cubic",))
'''


def _collect(pytester, *options):
    """A pytest session over a demo suite, in this process (pytester: the mlipdd plugin
    loads through its entry point as in a fresh `pytest`, without an interpreter start)."""
    pytester.makepyfile(test_suite_demo=SUITE)
    return pytester.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider", *options)


def _ids(result) -> list[str]:
    return sorted(line.split("::", 1)[1] for line in result.outlines if "::" in line)


def test_each_suite_keeps_its_own_world_sizes(pytester):
    result = _collect(pytester)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    assert _ids(result) == ["test_toy[2-cubic]"]


def test_command_line_world_sizes_override_the_suite(pytester):
    result = _collect(pytester, "--mlipdd-world-sizes=3,4")
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    assert _ids(result) == ["test_toy[3-cubic]", "test_toy[4-cubic]"]


def test_a_bad_value_names_the_fix(pytester):
    result = _collect(pytester, "--mlipdd-world-sizes=two")
    assert result.ret != 0
    assert "write e.g. --mlipdd-world-sizes=2,3,4" in result.stdout.str() + result.stderr.str()


def other_weights_on_ranks():
    """A model whose ranks hold other weights than the reference process: silently wrong."""
    import torch.distributed as dist
    from mlipdd.testing.toy_models import ToyMPNN

    return ToyMPNN(seed=1 if dist.is_initialized() else 0)


def test_every_cell_of_a_wrong_model_fails():
    """The suite runs every cell of a rank count in one launch and checks each cell apart:
    each of them still fails on its own numbers."""
    import pytest
    from mlipdd.testing import conformance_suite

    suite = conformance_suite(other_weights_on_ranks, species=(18,), cells=("cubic", "slab"))
    for cell in ("cubic", "slab"):
        with pytest.raises(AssertionError, match="2 ranks differ from one process"):
            suite(cell, world_size=2)
