"""Notebook 06's appendix section "A.1 FSDP inside tensor parallelism", run from the notebook's
own cells.

One 4-rank launch (cell `fsdp-tp-launch`, dp 2 x tp 2) builds the composed GPT with ZeRO 0 to
3, takes a step with each, saves the ZeRO-3 run's checkpoint and loads it as dp 4 x tp 1.
The cells after it assert their own claims; this file checks them again against numbers
worked out here from the tiny model's shape (C = 32, 4 C = 128 rows of `c_fc.weight`):

* the picture: tp rank t holds rows [64 t, 64 t + 64) of `c_fc.weight`; with FSDP inside
  tp, rank (dp d, tp t) holds rows [64 t + 32 d, 64 t + 32 d + 32), and the four blocks
  tile the matrix once;
* memory: each rank holds 16, 12, 10 and 8 bytes per TP-local number with ZeRO 0, 1, 2, 3,
  Psi being the numbers of the rank's TP-local tensors (counted here from their shapes);
* the checkpoint: the ranks' writes add up to 12 bytes per number of the model plus 4 per
  tensor (AdamW's step), the other layout loads the same weights bit for bit and takes the
  same next step (its loss and weights within the course's bounds, `reference.tolerance`).
"""
import math

import pytest
from notebook_cells import NB06, run_cells
from reference import tolerance
from notebook_cells import cells as nb_cells

SECTION = ["fsdp-tp-intro", "fsdp-tp-built", "fsdp-tp-run", "fsdp-tp-run-md", "fsdp-tp-launch",
           "fsdp-tp-rows-md", "fsdp-tp-rows", "fsdp-tp-picture-md", "fsdp-tp-picture", "fsdp-tp-mem-md",
           "fsdp-tp-memory", "fsdp-tp-ckpt-md", "fsdp-tp-checkpoint", "fsdp-tp-reload-md", "fsdp-tp-reload"]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ns():
    # each cell asserts its own claims
    return run_cells(NB06, "setup", "fsdp-tp-run", "fsdp-tp-launch", "fsdp-tp-rows", "fsdp-tp-picture",
                     "fsdp-tp-memory", "fsdp-tp-checkpoint", "fsdp-tp-reload", name="nb06_fsdp_tp_cells")


def test_the_section_opens_the_appendix_after_the_exercises_without_outputs():
    cells = nb_cells(NB06)
    ids = [c.get("id") for c in cells]
    start = ids.index(SECTION[0])
    assert ids[start:start + len(SECTION)] == SECTION
    # after the exercises, in the appendix marked as going further; then A.2 (test_nb06_fsdp_pp.py)
    assert ids.index("exercises") < ids.index("appendix") == start - 1
    assert "".join(cells[start - 1]["source"]).startswith("## Appendix · Going further")
    assert "".join(cells[start + len(SECTION)]["source"]).startswith("### A.2 ZeRO-3 with a pipeline")
    assert "".join(cells[start]["source"]).startswith("### A.1 FSDP inside tensor parallelism")
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in cells[start:start + len(SECTION)] if c["cell_type"] == "code")


def test_the_text_says_what_per_tensor_sharding_buys_not_that_flat_buffers_cannot_fit():
    """Flat-buffer sharding fits beside TP (step 6's ZeRO-1 shards such a buffer and equals one
    process, asserted by its cell); the intro says so and names what per-tensor sharding buys."""
    from notebook_cells import source
    prose = " ".join(source(NB06, "fsdp-tp-intro").split())
    assert "does not fit" not in prose
    assert "fits beside tensor parallelism too" in prose and "step 6's ZeRO-1" in prose
    assert "slice of named tensors" in prose and "padded on its own" in prose
    assert "ZeroOptimizer(params(stages)" in source(NB06, "my-train")  # the flat buffer beside tp


def test_each_rank_holds_its_dp_half_of_its_tp_rows(ns):
    runs, held = ns["fsdp_tp"], ns["held"]
    c = ns["CFG"].n_embd
    assert ns["four_c"] == 4 * c and len(runs) == 4
    for r, out in enumerate(runs):
        d, t = out["coords"].dp, out["coords"].tp
        assert r == 2 * d + t                        # tp neighbours, dp outside
        assert held[0][r] == [(2 * c * t, 2 * c * t + 2 * c)]
        assert held[3][r] == [(2 * c * t + c * d, 2 * c * t + c * d + c)]
    fig = ns["fig"]
    assert len(fig.axes) == 2 and all(len(ax.patches) == 4 for ax in fig.axes)


def test_memory_per_rank_is_the_formula_with_the_tp_local_count(ns):
    shapes = ns["fsdp_tp"][0]["tp_local_rows"]
    psi = sum(math.prod(s) for s in shapes.values())  # this rank's TP-local numbers
    assert ns["psi"] == psi
    for stage, per_number in zip(range(4), (16, 12, 10, 8)):
        for out in ns["fsdp_tp"]:
            m = out["memory"][stage]
            assert m.model_states == per_number * psi, (stage, m)
    z3 = ns["zero_tp_bytes"][3]
    assert (z3.params, z3.grads, z3.optimizer_state) == (2 * psi, 2 * psi, 4 * psi)  # 4, 4, 8 over dp 2
    z0 = ns["zero_tp_bytes"][0]
    assert (z0.params, z0.grads, z0.optimizer_state) == (4 * psi, 4 * psi, 8 * psi)


def test_the_checkpoint_is_written_once_and_loads_into_dp4(ns):
    runs = ns["fsdp_tp"]
    whole = runs[0]["whole"]
    n = sum(w.numel() for w in whole.values())
    assert sum(out["wrote"]["written"] for out in runs) == 12 * n + 4 * len(whole)
    for out in runs:  # its rows of the weights and of the two moments: 3 x its ZeRO-3 parameters
        assert out["wrote"]["handed"] == 3 * out["memory"][3].params
    assert ns["RELOAD"].dp == 4 and ns["RELOAD"].tp == 1 and ns["RELOAD"].zero3_by_blocks
    assert runs[0]["same"] and all(runs[0]["same"].values()) and set(runs[0]["same"]) == set(whole)
    a, b = runs[0]["next"]
    tolerance.loss().assert_losses([b], [a], "the next step's loss")
    after_a, after_b = runs[0]["after"]  # the second AdamW step, in each layout
    tolerance.adamw_weights(2, ns["LR"]).assert_weights(after_b, after_a, "after the next step")
    assert all(out["next"] == runs[0]["next"] for out in runs)  # every rank reports the same losses
