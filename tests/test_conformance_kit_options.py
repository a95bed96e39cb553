"""The conformance kit's pytest option: ``--mlipdd-world-sizes`` sets the rank counts of
every `conformance_suite`; without it each suite keeps its own. Collection only: no
ranks are spawned here (the suites themselves run in the plugins' tests)."""

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
