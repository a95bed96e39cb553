# mlipdd developer entry points.  `make demo` runs the built-in default; `make test`
# runs every test (core + all plugins) in one environment; .ci/run calls `make test`.
# `make dist` builds the wheels a user installs with
#   pip install --find-links dist -c requirements/torch.txt 'mlipdd[mace,uma]'
#
# ONE environment for all plugins, with one documented override:
#   mace-torch 0.3.16 pins e3nn==0.4.4, fairchem-core 2.24.0 (UMA) needs e3nn>=0.5,
#   so pip cannot install both as declared (and pip has no override option). MACE runs
#   correctly on e3nn 0.6.0, so tools/build_dist.py rewrites mace-torch's wheel with
#   that one pin moved to e3nn==0.6.0, as version 0.3.16+e3nn060 (code unchanged);
#   pip picks it from --find-links by itself.
# torch is pinned to 2.13.0 (what fairchem-core pins) and installed first: on our
# machines pip takes its CPU build from local disk, an unpinned torch pulls GBs of CUDA.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# One thread per process: tests spawn several ranks on machines with few cores.
export OMP_NUM_THREADS ?= 1
# Spawned test ranks import model packages once, in pytest's forkserver: tests/conftest.py and
# the plugins' conftests list them there (an exported variable would reach every program a
# test starts, and each would import them first).
# Rank counts: each conformance suite states its own (conformance_suite's default is 2, 3, 4;
# a few cheap selections run at 2 only). `make test WORLD_SIZES=2` narrows every suite to 2.
WORLD_SIZES ?=

# Plugins are picked up from plugins/* once they have a pyproject.toml.
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
PLUGINS_WITHOUT_PYPROJECT := $(filter-out $(PLUGIN_DIRS),$(patsubst %/,%,$(wildcard plugins/*/)))
PLUGIN_TEST_DIRS := $(wildcard $(addsuffix /tests,$(PLUGIN_DIRS)))
INSTALL_STAMP := $(VENV)/.mlipdd-install-stamp
# mace-torch with the e3nn override (see above), for the editable install
UPSTREAM_WHEELS := build/upstream-wheels
DIST ?= dist

.PHONY: venv install demo test test-full lint dist docs clean distclean

venv: $(PY)

$(PY):
	$(PYTHON) -m venv $(VENV)

install: $(INSTALL_STAMP)

# Re-run the install only when a dependency declaration changed.
$(INSTALL_STAMP): $(PY) pyproject.toml $(wildcard requirements/*.txt) $(addsuffix /pyproject.toml,$(PLUGIN_DIRS)) tools/build_dist.py
	$(if $(PLUGINS_WITHOUT_PYPROJECT),@echo "skipping $(PLUGINS_WITHOUT_PYPROJECT): no pyproject.toml yet")
	$(PIP) install -r requirements/torch.txt
	$(PY) tools/build_dist.py --upstream-only $(UPSTREAM_WHEELS)
	# One resolver pass: core (editable, test extra) and every plugin (editable) with the
	# upstreams they declare (mace-torch from $(UPSTREAM_WHEELS), fairchem-core, aimnet,
	# ...), plus the ewald_pme test oracles (requirements/ewald-pme-upstream.txt).
	$(PIP) install --find-links $(UPSTREAM_WHEELS) -c requirements/torch.txt \
		-r requirements/ewald-pme-upstream.txt -e '.[test]' $(addprefix -e ,$(PLUGIN_DIRS))
	# Guard the override: both upstreams import side by side, e3nn is 0.6.0.
	$(PY) -c "import e3nn, mace.modules; \
		from fairchem.core.models.uma.escn_md import eSCNMDBackbone; \
		assert e3nn.__version__ == '0.6.0', e3nn.__version__"
	touch $@

demo: install
	$(VENV)/bin/mlipdd run

TEST_COMMAND = $(PY) -m pytest tests $(PLUGIN_TEST_DIRS) $(if $(WORLD_SIZES),--mlipdd-world-sizes=$(WORLD_SIZES)) --durations=40

test: install
	$(TEST_COMMAND)

# the same run plus the tests marked `slow` (mlipdd.testing.slow_tier): the fresh-venv install, the compiled
# plugin models, the long MD runs
test-full: install
	MLIPDD_SLOW_TESTS=1 $(TEST_COMMAND)

# Wheels of the core, every plugin and the e3nn-0.6 mace-torch; see the README's Install.
dist: venv
	$(PY) tools/build_dist.py $(DIST)

# API reference from the docstrings (mkdocs.yml; mkdocs + mkdocstrings from the `docs` extra,
# which the `test` extra includes): build/site/index.html. Strict: a warning fails the build.
docs: install
	$(VENV)/bin/mkdocs build

# Lint needs only ruff, not the full install.
lint: venv
	$(PIP) install --quiet -r requirements/lint.txt
	$(VENV)/bin/ruff check core tests $(PLUGIN_DIRS)

clean:
	rm -rf build dist .pytest_cache .ruff_cache $(INSTALL_STAMP)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .tox
