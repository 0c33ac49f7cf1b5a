# Two commands do everything on a fresh machine (each installs into .venv first):
#   make run    the main job: the quick depth-stability experiment, report and plots
#   make test   ruff and mypy, then the whole test suite
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
	$(PY) -m pip install -q -e ".[torch,experiments,dev,hf,orbax]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m experiments.stability    # quick preset -> experiments/stability/runs/quick/ (report.md + plots; untracked)

test: $(STAMP)
	$(PY) -m ruff check flax_blocks torch_blocks parity_tests experiments tests
	$(PY) -m mypy    # flax_blocks and torch_blocks (pyproject.toml's [tool.mypy])
	$(PY) -m pytest -q -n 2 --dist loadgroup   # a module marked xdist_group runs on one worker (its fixtures built once)

clean:
	rm -rf $(VENV) .pytest_cache

# make test-gpu   the accelerator parity (parity_tests/twins/test_accelerator.py) on a machine with
#   an NVIDIA GPU: CUDA builds of torch and JAX in their own venv, .venv-gpu, so the CPU venv
#   above stays as it is. PyPI's Linux wheel of torch 2.14.1 is a CUDA 13 build (2.13.0 here
#   is a CPU file on this disk), and jax[cuda13] at the pinned jaxlib takes the same CUDA 13
#   libraries; both go in one pip call, so one resolver picks one set of NVIDIA packages.
#   Another CUDA: TORCH_CUDA=..., JAX_CUDA='jax[cuda12]==0.10.2', TORCH_INDEX_URL=<a PyTorch
#   wheel index>. Without a visible GPU the tests skip and say why (-rs).
GPU_VENV        := .venv-gpu
GPU_PY          := $(GPU_VENV)/bin/python
GPU_STAMP       := $(GPU_VENV)/.installed
TORCH_CUDA      ?= torch==2.14.1
JAX_CUDA        ?= jax[cuda13]==0.10.2
TORCH_INDEX_URL ?=

.PHONY: test-gpu

$(GPU_STAMP): pyproject.toml
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q --upgrade pip
	$(GPU_PY) -m pip install -q "$(TORCH_CUDA)" "$(JAX_CUDA)" $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL))
	$(GPU_PY) -m pip install -q -e ".[torch,dev]"
	$(GPU_PY) -c "import torch; assert torch.version.cuda, 'torch ' + torch.__version__ + ' is a CPU build'"
	touch $(GPU_STAMP)

test-gpu: $(GPU_STAMP)
	$(GPU_PY) -c "import jax, torch; print('JAX devices:', jax.devices(), '| torch CUDA', torch.version.cuda, 'available:', torch.cuda.is_available())"
	$(GPU_PY) -m pytest -q -rs -p no:cacheprovider parity_tests/twins/test_accelerator.py
