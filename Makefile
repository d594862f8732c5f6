# The two commands a new user needs: `make demo` and `make test`.
# Both create .venv on first use, install from pyproject.toml pinned by
# requirements/constraints.txt, and are safe to run again.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q -c requirements/constraints.txt
DEPS := pyproject.toml requirements/constraints.txt

.PHONY: demo test test-all test-loaded test-skypilot test-llamafactory bench install clean docs lint

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip

$(VENV)/.installed-base: $(PY) $(DEPS)
	$(PIP) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-base $(DEPS)
	$(PIP) -e '.[test]'
	touch $@

$(VENV)/.installed-lint: $(VENV)/.installed-test $(DEPS)
	$(PIP) -e '.[test,lint]'
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed-base $(DEPS)
	$(PIP) -e '.[bench]'
	touch $@

$(VENV)/.installed-docs: $(VENV)/.installed-base $(DEPS)
	$(PIP) -e '.[docs]'
	touch $@

install: $(VENV)/.installed-base

demo: $(VENV)/.installed-base
	$(VENV)/bin/skylift run examples/quickstart.yaml

# Two lanes. `make test`, the fast lane a person runs before a commit: every module's unit
# and integration tests and a small end-to-end set, everything not marked slow. `make
# test-all`, what CI runs: the slow end-to-end runs too. tests/lanes.py lists each fast-lane
# test over 10 s and fails one over LANE_FAIL_S, naming the marker to add (0: never, for a
# pass on slower kernels, where wall time says nothing about the lane).
PYTEST_MARKERS ?= not gpu and not slow
LANE_FAIL_S ?= 30
PYTEST_ARGS ?=
# PYTEST_WORKERS: that many pytest-xdist worker processes, each test file whole on one worker,
# so a module's shared runs are trained once. Each worker gets its share of the cores for its
# own torch and every process it starts (tests/conftest.py). Two by default: most of an
# end-to-end test is a Python start importing torch, which leaves one process's second core
# idle. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
# --max-worker-restart=0: a worker that dies (the kernel's OOM killer, a native crash) fails the
# run at once naming the test it ran; pytest-xdist 3.6-3.8 replacing it under --dist loadfile
# can deadlock at the end of the run (pytest-dev/pytest-xdist#784, #1378) until CI's own limit.
XDIST := $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --max-worker-restart=0)

test: $(VENV)/.installed-test
	$(PY) -m pytest -m "$(PYTEST_MARKERS)" -q --durations=15 --lane-fail-s=$(LANE_FAIL_S) $(XDIST) $(PYTEST_ARGS)

test-all: $(VENV)/.installed-test
	$(MAKE) --no-print-directory test PYTEST_MARKERS="not gpu"

# The spawned-rank and end-to-end tests while a CPU hog keeps every core busy (one busy
# process per core, ended with the run): a rank that aborts, or a wait tuned to a quiet
# machine, shows up here before it shows up on a loaded CI machine or a user's node.
test-loaded: $(VENV)/.installed-test
	@hogs=""; for core in $$(seq $$(nproc)); do $(PY) -c "while True: pass" & hogs="$$hogs $$!"; done; \
	trap 'kill $$hogs 2>/dev/null' EXIT; \
	$(MAKE) --no-print-directory test PYTEST_MARKERS="not gpu and (multiprocess or slow)" LANE_FAIL_S=0

# SkyPilot's own code checks the task YAML `skylift submit --platform skypilot` writes,
# in a venv of its own (see requirements/test-skypilot.txt for why).
SKY_VENV ?= .venv-skypilot
$(SKY_VENV)/.installed: requirements/test-skypilot.txt
	$(PYTHON) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/python -m pip install --disable-pip-version-check -q -r requirements/test-skypilot.txt
	touch $@

test-skypilot: $(SKY_VENV)/.installed
	SKYLIFT_REQUIRE_SKYPILOT=1 PYTHONPATH=src:. $(SKY_VENV)/bin/python -m pytest --noconftest -q \
		-p no:cacheprovider tests/submit/test_skypilot_real.py

# LLaMA-Factory's own CLI under skylift launch, in a venv that reads .venv's packages and
# adds LLaMA-Factory's older pins on top (see requirements/test-llamafactory.txt for why).
LF_VENV ?= .venv-llamafactory
$(LF_VENV)/.installed: requirements/test-llamafactory.txt $(VENV)/.installed-test
	$(PYTHON) -m venv $(LF_VENV)
	$(LF_VENV)/bin/python -c "import sysconfig; from pathlib import Path; \
		project = Path('$(abspath $(VENV))', 'lib', 'python' + sysconfig.get_python_version(), 'site-packages'); \
		Path(sysconfig.get_path('purelib'), 'zz_project_venv.pth').write_text(f'import site; site.addsitedir({str(project)!r})\n')"
	$(LF_VENV)/bin/python -m pip install --disable-pip-version-check -q -r requirements/test-llamafactory.txt
	touch $@

# Absolute paths: the launched workers run in the test's scratch folder.
test-llamafactory: $(LF_VENV)/.installed
	PYTHONPATH=$(CURDIR)/src:$(CURDIR) $(LF_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/launch/test_llamafactory.py

bench: $(VENV)/.installed-bench
	$(PY) -m benchmarks.trainer_overhead

# ruff on the code, the tests and the benchmarks, then mypy on src/ (both configured in
# pyproject.toml). mypy reads the installed packages' types, so it runs in the test environment.
lint: $(VENV)/.installed-lint
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy src

# The documentation site into site/; --strict: a broken link or a missing page fails.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(SKY_VENV) $(LF_VENV) runs .pytest_cache .mypy_cache .ruff_cache
