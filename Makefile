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

# Workers, each taking whole test files (module fixtures such as the graded homework run
# once): one per core this make may use (CPU affinity, so `taskset -c 0-3 make test` gives
# 4), at least 2. A file's ranks (2 to 8 processes) wait on each other often enough that on
# 2 cores two files at a time beat one (measured); a worker per core on larger machines is
# that ratio kept, not yet measured against others. The files go out in the order
# tests/conftest.py sorts them, longest first: --no-loadscope-reorder keeps pytest-xdist
# from sorting them by their number of tests instead. `make test PYTEST_WORKERS=N` sets the
# workers, `CORES=N` the cores they follow (docs/testing.md).
CORES ?= $(shell $(PYTHON) -c "import os; print(len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1)")
PYTEST_WORKERS ?= $(shell [ "$(CORES)" -gt 2 ] 2>/dev/null && echo "$(CORES)" || echo 2)
#
# Then the parity files once more under a second set of kernels, so that one machine sees
# two: ATen's AVX2 kernels and MKL's reproducible COMPATIBLE path round matrix products
# differently from this CPU's own choice. `make numerics` runs every notebook and the other
# parity files under every setting (too long for `make test`).
SECOND_KERNELS ?= MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=avx2
SECOND_KERNEL_TESTS ?= tests/test_tolerance.py tests/test_parallel_parity.py tests/test_parallel_cp.py \
	tests/test_pipeline_parity.py
test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
	@echo "== the parity tests again under $(SECOND_KERNELS)"
	env $(SECOND_KERNELS) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -q $(SECOND_KERNEL_TESTS)

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

# The parity and numerical tests, and every notebook (whose cells assert their own parity),
# under the kernels other CPUs pick: ATEN_CPU_CAPABILITY (ATen's default, avx2, avx512
# kernels), MKL_CBWR (MKL's path for matrix products, which it picks by CPU vendor as well as
# instruction set: the machine's own, AVX2 as on an AMD CPU, COMPATIBLE, AVX512), and 1 or 2
# intra-op threads per rank (COURSE_RANK_THREADS). The full product is 24 runs; these
# settings cover every value of every factor (the AVX-512 ones where this CPU has it). A
# failure prints its setting: prefix the same variables to one test to reproduce it.
NUMERICS_TESTS ?= tests/test_tolerance.py tests/test_parallel_sweep.py tests/test_parallel_parity.py tests/test_composition_findings.py \
	tests/test_data_parallel.py tests/test_zero.py tests/test_clip.py tests/test_pipeline_parity.py \
	tests/test_tensor_parallel_gpt.py tests/test_tensor_parallel_layers.py tests/test_tensor_parallel_loss.py \
	tests/test_expert_parallel_dist.py tests/test_context_parallel.py tests/test_parallel_cp.py \
	tests/test_parallel_fp16.py tests/test_adam8bit.py tests/test_optimizer_wrappers.py tests/test_pipeline_tp.py \
	tests/test_fsdp_composed.py tests/test_fsdp_experts.py tests/test_moe_sequence_parallel.py tests/test_fsdp_reshard.py \
	tests/test_pipeline_zero_bubble.py tests/test_loss_mean.py tests/test_bias_balance.py tests/test_hsdp.py \
	tests/test_notebooks.py::test_notebook_runs_headless_within_budget
NUMERICS_SETTINGS ?= COURSE_RANK_THREADS=1 \
	ATEN_CPU_CAPABILITY=default,MKL_CBWR=COMPATIBLE,COURSE_RANK_THREADS=1 \
	ATEN_CPU_CAPABILITY=avx2,MKL_CBWR=AVX2,COURSE_RANK_THREADS=2 \
	ATEN_CPU_CAPABILITY=default,MKL_CBWR=AVX2,COURSE_RANK_THREADS=2 \
	ATEN_CPU_CAPABILITY=avx2,MKL_CBWR=COMPATIBLE,COURSE_RANK_THREADS=1
NUMERICS_AVX512 ?= ATEN_CPU_CAPABILITY=avx512,MKL_CBWR=AVX512,COURSE_RANK_THREADS=1 \
	ATEN_CPU_CAPABILITY=avx512,MKL_CBWR=COMPATIBLE,COURSE_RANK_THREADS=2
numerics: $(STAMP)
	@settings="$(NUMERICS_SETTINGS)"; grep -q avx512f /proc/cpuinfo 2>/dev/null && settings="$$settings $(NUMERICS_AVX512)"; \
	for setting in $$settings; do \
	  vars=$$(echo $$setting | tr , ' '); echo "== $$vars"; \
	  env $$vars $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -q $(NUMERICS_TESTS) \
	    || { echo "failed under: $$vars"; exit 1; }; \
	done
