# Two commands, each doing its own set-up on a fresh machine:
#   make book   renders the book to HTML in _build/html
#   make test   runs every test: unit, property, kernel (Triton interpreter, nvcc), nbval, book build
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.flashref-installed

.PHONY: test book gpu-test clean

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile

book: $(STAMP)
	$(VENV)/bin/jupyter-book build . -W -n --keep-going

clean:
	rm -rf _build $(VENV)
