# Two commands, each doing its own set-up on a fresh machine:
#   make book   renders the book to HTML in _build/html
#   make test   checks that the pins resolve from the public index, then runs every test (unit, property,
#               kernel in the Triton interpreter, nvcc, nbval, book build) under the OpenBLAS kernels CI machines
#               pick, and the NumPy arithmetic under the older ones (tests/openblas_cores.py says which)
# make test-once runs the tests once, with the OpenBLAS kernels this CPU picks (quicker, for development).
# TORCH_INDEX=https://download.pytorch.org/whl/cpu installs the CPU-only torch (a .venv of about 2 GB, not 5 GB).
PYTHON      ?= python3
TORCH_INDEX ?=
VENV        := .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.flashref-installed
PYTEST_ARGS := -n 2 --dist loadfile

.PHONY: test test-once check-install book clean

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_INDEX),$(PY) -m pip install -q torch==$$(sed -n 's/^torch==\([^ ]*\).*/\1/p' requirements.txt) --index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

# What a reader's machine sees: pip's own configuration ignored, the public index only. Resolves, downloads nothing.
check-install: $(STAMP)
	PIP_CONFIG_FILE=/dev/null $(PY) -m pip install -q --dry-run --isolated --ignore-installed -r requirements.txt
	@echo "requirements.txt resolves from the public index"

test: check-install
	$(PY) tests/openblas_cores.py $(PYTEST_ARGS)

test-once: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

book: $(STAMP)
	$(VENV)/bin/jupyter-book build . -W -n --keep-going

clean:
	rm -rf _build $(VENV)
