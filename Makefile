# Two commands do all the set-up:
#   make lab    create .venv if needed, then open JupyterLab on the course
#   make test   create .venv if needed, then run every test
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: lab test browser-test exercises bench demo clean numerics

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

# Two workers, each taking whole test files (module fixtures such as the graded homework
# run once): the ranks a test starts wait on each other often enough that two files at a
# time use the two cores of a laptop better than one.
PYTEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile

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

# The parity and numerical tests under each kernel family PyTorch can pick on this CPU
# (ATEN_CPU_CAPABILITY) and at 1 and 2 intra-op threads per rank (COURSE_RANK_THREADS):
# a tolerance that holds on one machine must hold on all of them.
NUMERICS_TESTS ?= tests/test_parallel_sweep.py tests/test_parallel_parity.py tests/test_composition_findings.py \
	tests/test_data_parallel.py tests/test_zero.py tests/test_clip.py tests/test_pipeline_parity.py \
	tests/test_tensor_parallel_gpt.py tests/test_tensor_parallel_layers.py tests/test_tensor_parallel_loss.py \
	tests/test_expert_parallel_dist.py tests/test_context_parallel.py tests/test_parallel_cp.py \
	tests/test_parallel_fp16.py tests/test_adam8bit.py tests/test_optimizer_wrappers.py tests/test_pipeline_tp.py \
	tests/test_fsdp_composed.py tests/test_fsdp_experts.py tests/test_moe_sequence_parallel.py tests/test_fsdp_reshard.py
numerics: $(STAMP)
	@caps="default avx2"; grep -q avx512f /proc/cpuinfo 2>/dev/null && caps="$$caps avx512"; \
	for cap in $$caps; do for t in 1 2; do \
	  echo "== ATEN_CPU_CAPABILITY=$$cap COURSE_RANK_THREADS=$$t"; \
	  ATEN_CPU_CAPABILITY=$$cap COURSE_RANK_THREADS=$$t $(BIN)/python -m pytest -q $(NUMERICS_TESTS) || exit 1; \
	done; done
