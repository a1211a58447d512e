# `make test` and `make demo` each set up .venv on their own. torch==2.13.0 is installed first:
# a bare `torch` requirement would pull a CUDA build of several GB. The `apex` compatibility
# package (compat/apex) is installed after amp, editable so that the tests see its source, and the
# install must leave that torch in place.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test test-all demo benchmark clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml compat/apex/setup.cfg
	$(BIN)/python -m pip install --quiet -e '.[test,demo,lightning]'
	$(BIN)/python -m pip install --quiet -e ./compat/apex
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

# `test` leaves out the tests marked slow (the whole benchmark suite, compiled graphs, two-rank
# jobs); `test-all` runs everything.
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(VENV)/.installed
	$(BIN)/python -m pytest -q

demo: $(VENV)/.installed
	$(BIN)/python examples/demo.py

benchmark: $(VENV)/.installed
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info compat/apex/build compat/apex/*.egg-info
