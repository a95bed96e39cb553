# mlipdd developer entry points.  `make demo` runs the built-in default; `make test`
# runs every test (core + all plugins) in one environment; .ci/run calls `make test`.
#
# ONE environment for all plugins, with one documented override:
#   mace-torch 0.3.16 pins e3nn==0.4.4, fairchem-core 2.24.0 (UMA) needs e3nn>=0.5,
#   so pip cannot install both as declared. MACE runs correctly on e3nn 0.6.0, so we
#   install mace-torch's real runtime dependencies with e3nn==0.6.0
#   (requirements/mace-upstream.txt) and then mace-torch itself with --no-deps
#   (requirements/mace-nodeps.txt). `pip check` reports that e3nn mismatch; expected.
# torch is pinned to 2.13.0 (what fairchem-core pins) and installed first: on our
# machines pip takes its CPU build from local disk, an unpinned torch pulls GBs of CUDA.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# One thread per process: tests spawn several ranks on machines with few cores.
export OMP_NUM_THREADS ?= 1
# Spawned test ranks import mace once (in their forkserver), not once per rank.
export MLIPDD_SPAWN_PRELOAD ?= mace.modules
# Rank counts of every conformance suite (mlipdd.testing.conformance_suite): the full matrix.
WORLD_SIZES ?= 2,3,4

# Plugins are picked up from plugins/* once they have a pyproject.toml.
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
PLUGINS_WITHOUT_PYPROJECT := $(filter-out $(PLUGIN_DIRS),$(patsubst %/,%,$(wildcard plugins/*/)))
PLUGIN_TEST_DIRS := $(wildcard $(addsuffix /tests,$(PLUGIN_DIRS)))
INSTALL_STAMP := $(VENV)/.mlipdd-install-stamp

.PHONY: venv install demo test lint clean distclean

venv: $(PY)

$(PY):
	$(PYTHON) -m venv $(VENV)

install: $(INSTALL_STAMP)

# Re-run the install only when a dependency declaration changed.
$(INSTALL_STAMP): $(PY) pyproject.toml $(wildcard requirements/*.txt) $(addsuffix /pyproject.toml,$(PLUGIN_DIRS))
	$(if $(PLUGINS_WITHOUT_PYPROJECT),@echo "skipping $(PLUGINS_WITHOUT_PYPROJECT): no pyproject.toml yet")
	$(PIP) install -r requirements/torch.txt
	# One resolver pass: core (editable, test extra), MACE's real dependencies with the
	# e3nn override, fairchem-core and aimnet with their dependencies, the ewald_pme upstreams.
	$(PIP) install -r requirements/torch.txt -r requirements/mace-upstream.txt \
		-r requirements/uma-upstream.txt -r requirements/aimnet2-upstream.txt \
		-r requirements/ewald-pme-upstream.txt -e '.[test]'
	# The plugins (editable) without a second resolver pass: mlipdd-mace declares
	# mace-torch, whose e3nn==0.4.4 pin is the override above; every plugin's upstream
	# is already in place from the requirements files.
	$(PIP) install --no-deps $(addprefix -e ,$(PLUGIN_DIRS))
	# mace-torch itself, without its e3nn==0.4.4 pin (see the top of this file).
	$(PIP) install --no-deps -r requirements/mace-nodeps.txt
	# Guard the override: both upstreams import side by side, e3nn is 0.6.0.
	$(PY) -c "import e3nn, mace.modules; \
		from fairchem.core.models.uma.escn_md import eSCNMDBackbone; \
		assert e3nn.__version__ == '0.6.0', e3nn.__version__"
	touch $@

demo: install
	$(VENV)/bin/mlipdd run

test: install
	$(PY) -m pytest tests $(PLUGIN_TEST_DIRS) --mlipdd-world-sizes=$(WORLD_SIZES)

# Lint needs only ruff, not the full install.
lint: venv
	$(PIP) install --quiet -r requirements/lint.txt
	$(VENV)/bin/ruff check core tests $(PLUGIN_DIRS)

clean:
	rm -rf build dist .pytest_cache .ruff_cache $(INSTALL_STAMP)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .tox
