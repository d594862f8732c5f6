# The two commands a new user needs: `make demo` and `make test`.
# Both create .venv on first use, install from pyproject.toml pinned by
# requirements/constraints.txt, and are safe to run again.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q -c requirements/constraints.txt
DEPS := pyproject.toml requirements/constraints.txt

.PHONY: demo test bench install clean

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

test: $(VENV)/.installed-test
	$(PY) -m pytest -m "not gpu" -q --durations=25

bench: $(VENV)/.installed-bench
	$(PY) -m benchmarks.trainer_overhead

clean:
	rm -rf $(VENV) runs .pytest_cache
