# The two commands a new user needs: `make demo` and `make test`.
# Both create .venv on first use, install from pyproject.toml pinned by
# requirements/constraints.txt, and are safe to run again.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q -c requirements/constraints.txt
DEPS := pyproject.toml requirements/constraints.txt

.PHONY: demo test test-skypilot bench install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip

$(VENV)/.installed-base: $(PY) $(DEPS)
	$(PIP) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-base $(DEPS)
	$(PIP) -e '.[test]'
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed-base $(DEPS)
	$(PIP) -e '.[bench]'
	touch $@

install: $(VENV)/.installed-base

demo: $(VENV)/.installed-base
	$(VENV)/bin/skylift run examples/quickstart.yaml

# Which tests `make test` runs; CI's second pass leaves out the slow end-to-end ones.
PYTEST_MARKERS ?= not gpu

test: $(VENV)/.installed-test
	$(PY) -m pytest -m "$(PYTEST_MARKERS)" -q --durations=25

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

bench: $(VENV)/.installed-bench
	$(PY) -m benchmarks.trainer_overhead

clean:
	rm -rf $(VENV) $(SKY_VENV) runs .pytest_cache
