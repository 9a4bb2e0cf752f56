# Two commands do all the set-up:
#   make lab    create .venv if needed, then open JupyterLab on the course
#   make test   create .venv if needed, then run every test
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: lab test browser-test exercises bench demo clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# Jupyter refuses to run as root unless told; containers often run as root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)
LAB_ARGS ?=

lab: $(STAMP)
	$(BIN)/jupyter lab $(ROOT_FLAG) --notebook-dir=. $(LAB_ARGS) notebooks/00_distributed_primer.ipynb

test: $(STAMP)
	$(BIN)/python -m pytest

# The course as a student sees it: JupyterLab started by `make lab`, driven in Chromium
# (tests/test_browser.py). Needs /usr/bin/chromium (apt-get install chromium); without
# it the test skips and says why. `make test` runs it too.
browser-test: $(STAMP)
	$(BIN)/python -m pytest -m browser tests/test_browser.py

exercises: $(STAMP)
	$(BIN)/python -m reference.course exercises

# The debug 3D configuration on 8 gloo ranks, its parity with one process, its loss curve.
demo: $(STAMP)
	$(BIN)/python -m reference.train --config configs/debug_3d.json --world-size 8
	$(BIN)/python -m reference.train parity runs/debug_3d.jsonl --config configs/debug_3d.json --world-size 8
	$(BIN)/python -m reference.train plot runs/debug_3d.jsonl --out runs/debug_3d.png

bench: $(STAMP)
	for f in bench/*.py; do $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
