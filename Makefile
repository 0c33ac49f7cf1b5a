# Two commands do everything on a fresh machine (each installs into .venv first):
#   make run    the main job: the quick depth-stability experiment, report and plots
#   make test   the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[torch,experiments,dev,hf]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m experiments.stability    # quick preset -> experiments/results/ (report.md + plots)

test: $(STAMP)
	$(PY) -m pytest -q -n 2

clean:
	rm -rf $(VENV) .pytest_cache
