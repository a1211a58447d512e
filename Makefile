# `make test` and `make demo` each set up .venv on their own. torch==2.13.0 is installed first:
# a bare `torch` requirement would pull a CUDA build of several GB. The `apex` compatibility
# package (compat/apex) is installed after amp, editable so that the tests see its source, and the
# install must leave that torch in place. The set-up says what it does, one line a step; pip is
# quiet but for torch, the longest step, whose download and install it shows.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --disable-pip-version-check

.PHONY: test test-all test-quick demo benchmark clean

$(BIN)/python:
	@echo "[make] 1/4 creating $(VENV) with $(PYTHON) (first run only; the set-up takes a few minutes)"
	$(PYTHON) -m venv $(VENV)
	@echo "[make] 2/4 installing torch 2.13.0 into $(VENV) (the largest download)"
	$(PIP) torch==2.13.0

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml compat/apex/setup.cfg
	@echo "[make] 3/4 installing amp (editable) with its test, demo, lightning and transformers extras: pytest, scikit-learn, matplotlib, lightning, transformers, ..."
	$(PIP) --quiet -e '.[test,demo,lightning,transformers]'
	@echo "[make] 4/4 installing the apex compatibility package (compat/apex, editable)"
	$(PIP) --quiet -e ./compat/apex
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@echo "[make] $(VENV) is ready"
	touch $@

# `test` leaves out the tests marked slow (the whole benchmark suite, compiled graphs, two-rank
# jobs); `test-all` runs everything; `test-quick` runs the units only (README gives the times).
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(VENV)/.installed
	$(BIN)/python -m pytest -q

test-quick: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not slow" --ignore=tests/programs --ignore=tests/kernels \
		--ignore=tests/lightning --ignore=tests/transformers

demo: $(VENV)/.installed
	$(BIN)/python examples/demo.py

benchmark: $(VENV)/.installed
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info compat/apex/build compat/apex/*.egg-info
