"""Notebook 06's composed step and its clinic, run from the notebook's own cells, and the
numbers its prose prints about GPT-3 175B.

* The step the student composes (cells `my-tp-model`, `my-pipeline`, `my-reduce`,
  `my-train`, `my-clip`) equals one process on 8 ranks, and each mistake the clinic plants
  leaves the symptom the notebook describes: the printed loss exactly 1/pp of one process's
  with the weights equal (loss averaged over pp); the weights off from the first steps (SP
  gradients not summed over tp; the tied embedding's copies drifting); the gradient norm
  too large (replicated parameters counted tp times); AdamW hiding a gradient dp times too
  small (dp averaged twice with ZeRO: the loss barely moves, the weights do).
* A different dropout mask on recompute (cell `clinic-dropout`): gradients off; the state
  restored: equal, bit for bit.
* GPT-3 175B, DP 32 x TP 8 x PP 4 with Megatron's bf16 convention (18 bytes per parameter,
  6 + 12/d with the distributed optimizer): 5.5B parameters on the first stage, does not
  fit 80 GB without ZeRO, fits with ZeRO-1, bubble 3/51; Megatron's published script
  (TP 8 x PP 16, fp16, 2 + 2 + 12): fits without ZeRO, bubble 15/207; 1024 GPUs are 128 nodes.
"""
import json

import pytest

from reference.memory import Precision
from reference.parallel import ParallelConfig
from reference.parallel.estimate import estimate
from reference.parallel.explorer import MODELS
from reference.runtime import launch
from notebook_cells import NB06 as NOTEBOOK
from notebook_cells import run_cells



def _namespace(*cell_ids, **given) -> dict:
    return run_cells(NOTEBOOK, *cell_ids, name="nb06_cells", **given)


@pytest.fixture(scope="module")
def cells():
    return _namespace("setup", "my-tp-model", "my-pipeline", "my-reduce", "my-train", "my-clip")


STEPS, MAX_NORM = 2, 0.5
MISTAKES = ["SP not summed over tp", "tied copies drift", "loss averaged over pp",
            "replicated counted tp times", "dp averaged twice with ZeRO"]


@pytest.mark.timeout(600)
def test_composed_step_equals_one_process_and_each_mistake_shows(cells):
    my_train = cells["my_train"]

    def all_runs():
        out = {"right": my_train(STEPS, MAX_NORM), "right, ZeRO-1": my_train(STEPS, None, True)}
        for name in MISTAKES:
            zero = name.endswith("ZeRO")
            out[name] = my_train(STEPS, None if zero else MAX_NORM, zero, False, (name,))
        return out

    runs = launch(all_runs, 8)[0]
    clip, plain = cells["one_process"](STEPS, MAX_NORM), cells["one_process"](STEPS)
    divergence = cells["divergence"]
    loss, weights, _ = divergence(runs["right"], clip)
    assert loss < 1e-5 and weights < 5e-6
    assert all(abs(a - c) / c < 1e-5 and abs(b - c) / c < 1e-5
               for (a, b), c in zip(runs["right"]["norms"], clip["norms"]))
    loss, weights, _ = divergence(runs["right, ZeRO-1"], plain)
    assert loss < 1e-5 and weights < 5e-6

    for name in ("SP not summed over tp", "tied copies drift"):
        assert divergence(runs[name], clip)[1] > 1e-3, name
    pp = runs["loss averaged over pp"]
    assert all(abs(a / b - 0.5) < 1e-5 for a, b in zip(pp["losses"], clip["losses"]))
    assert divergence({**pp, "losses": clip["losses"]}, clip)[1] < 5e-6  # training itself is right
    replicated = runs["replicated counted tp times"]
    assert replicated["norms"][0][0] / clip["norms"][0] > 1.01
    assert divergence(replicated, clip)[1] > 1e-4
    loss, weights, _ = divergence(runs["dp averaged twice with ZeRO"], plain)
    assert loss < 1e-4 and weights > 5e-6  # AdamW hides most of a constant factor, not all


def test_a_redrawn_dropout_mask_changes_the_gradients():
    ns = _namespace("setup", "clinic-dropout", symptoms={})  # the clinic cell's table
    assert ns["symptoms"]["different dropout mask on recompute"]["restored"] == 0.0
    assert ns["symptoms"]["different dropout mask on recompute"]["redrawn"] > 1e-3


def test_gpt3_175b_readings():
    gpt3 = MODELS["GPT-3 175B"]
    article = ParallelConfig(dp=32, tp=8, pp=4, sequence_parallel=True, microbatches=48, precision="bf16")
    megatron_bf16 = Precision(param=2, grad=4, optimizer=12)
    plain = estimate(gpt3, article, micro_batch=1, global_batch=1536, precision=megatron_bf16)
    zero1 = estimate(gpt3, article.with_(zero_stage=1), micro_batch=1, global_batch=1536,
                     precision=megatron_bf16)
    assert round(plain.params_per_gpu / 1e9, 1) == 5.5
    assert plain.model_states.model_states == 18 * plain.params_per_gpu
    assert zero1.model_states.model_states == pytest.approx((6 + 12 / 32) * plain.params_per_gpu, rel=1e-6)
    assert not plain.fits(80e9) and zero1.fits(80e9)
    assert plain.bubble == pytest.approx(3 / 51)
    megatron = ParallelConfig(dp=8, tp=8, pp=16, sequence_parallel=True, microbatches=192, precision="fp16")
    meg = estimate(gpt3, megatron, micro_batch=1, global_batch=1536, precision=Precision.mixed_adam())
    assert meg.fits(80e9) and meg.bubble == pytest.approx(15 / 207)
    assert meg.model_states.model_states == 16 * meg.params_per_gpu
    assert 1024 // 8 == 128 and article.tp * article.pp == 32


def test_notebook_keeps_its_exercises_last_and_no_outputs():
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    assert "## Exercises" in "".join(nb["cells"][-1]["source"])
    assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")
