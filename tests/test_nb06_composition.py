"""Notebook 06's composed step and its clinic, run from the notebook's own cells, and the
numbers its prose prints about GPT-3 175B.

* The embedding group the student forms (cell `my-embedding-group`: every rank makes every
  pipeline's group of its first and last stage) holds the same ranks as the package's
  `build_embedding_group`; copies that must stay equal (the tied embedding's two, each
  LayerNorm over tp, `copies-gap`) are equal bit for bit after every right run, and parted
  beyond an AdamW step (lr) without the embedding group's sum, beyond half of one without
  the SP sum over tp.
* The step the student composes (cells `my-tp-model`, `my-pipeline`, `my-reduce`,
  `my-train`, `my-clip`, `my-clip-norm`, `my-zero`) equals one process on 8 ranks within the
  course's bounds (`reference.tolerance`: the losses, every weight and their mean after
  AdamW's steps), clipped, and clipped under ZeRO-1 (the norm over the reduced shards, each
  step's norm one process's); in fp16 a step where one rank's gradient holds an inf is skipped
  on every rank, the scale halves, and the weights are one process's that skips it too (a step
  taken with the inf would leave NaN weights). Each mistake the clinic plants leaves the
  symptom the notebook describes, beyond those bounds: the printed loss 1/pp of one process's
  with the weights within rounding (loss averaged over pp); the mean weight difference beyond
  a correct run's from the first steps (SP gradients not summed over tp; the tied embedding's
  copies drifting; replicated parameters counted tp times, whose gradient norm is too large);
  dp averaged twice with ZeRO: the norm exactly 1/dp of one process's, the clip and AdamW
  hiding it in the weights, which SGD shows (its mean weight difference beyond SGD's bound for
  any single weight); the clip before ZeRO's reduce-scatter: dp rank 0's own norm.
* A different dropout mask on recompute (cell `clinic-dropout`): gradients off beyond
  rounding; the state restored: equal, bit for bit.
* GPT-3 175B, DP 32 x TP 8 x PP 4 with Megatron's bf16 convention (18 bytes per parameter,
  6 + 12/d with the distributed optimizer): 5.5B parameters on the first stage, does not
  fit 80 GiB without ZeRO, fits with ZeRO-1, bubble 3/51; Megatron's published script
  (TP 8 x PP 16, fp16 at 20 bytes per parameter, no SP, no recompute): about 52 GiB of
  activations on the first stage, fits 80 GiB (not 80e9 bytes) by about a GiB, bubble 15/207;
  1024 GPUs are 128 nodes.
* The notebook's shape: no code cell over 25 lines, at most four code cells in a row after a
  markdown cell; the summary, the exercises, then the appendix going further (the FSDP x TP
  and FSDP x PP measurements, and nothing else); no outputs.
"""
import json

import pytest
import torch

from reference import tolerance
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
    ns = _namespace("setup", "my-tp-model", "my-embedding-group", "my-pipeline", "my-reduce", "copies-gap",
                    "my-train", "one-process", "equals-one-process", "my-clip", "my-clip-norm", "my-zero")
    ns["CHUNKS"] = ns["CONFIG"].dp * ns["M_MICRO"]  # set by the cell that first trains
    return ns


STEPS, MAX_NORM = 2, 0.5
MISTAKES = ["SP not summed over tp", "tied copies drift", "loss averaged over pp",
            "replicated counted tp times", "dp averaged twice with ZeRO", "clip before ZeRO's reduce-scatter"]


@pytest.mark.timeout(600)
def test_composed_step_equals_one_process_and_each_mistake_shows(cells):
    my_train, one_process = cells["my_train"], cells["one_process"]
    sgd = torch.optim.SGD

    def all_runs():
        mesh = cells["Mesh"](**cells["DIMS"]).build_groups()
        ranks_of = cells["dist"].get_process_group_ranks
        groups = (ranks_of(cells["my_embedding_group"](mesh)), ranks_of(cells["build_embedding_group"](mesh)))
        out = {"groups": groups, "right": my_train(STEPS, MAX_NORM), "right, ZeRO-1": my_train(STEPS, MAX_NORM, True),
               "fp16, overflow": my_train(STEPS, MAX_NORM, True, True, overflow_at=0)}
        for name in MISTAKES:
            out[name] = my_train(STEPS, MAX_NORM, "ZeRO" in name, False, (name,))
        out["ZeRO, SGD"] = my_train(STEPS, None, True, False, ("dp averaged twice with ZeRO",), sgd)
        return out

    ranks = launch(all_runs, 8)
    runs = ranks[0]
    # the embedding group the student forms: the package's, on every rank (first and last stage)
    for rank, r in enumerate(ranks):
        mine, package = r["groups"]
        assert mine == package == [rank % 4, rank % 4 + 4], (rank, mine, package)
    # copies that must stay equal: bit for bit in every right run; parted by the two mistakes
    for name in ("right", "right, ZeRO-1", "fp16, overflow", "loss averaged over pp"):
        assert runs[name]["copies"] == dict(tied=0.0, ln=0.0), name
    lr = cells["LR"]
    assert runs["tied copies drift"]["copies"]["tied"] > lr and runs["tied copies drift"]["copies"]["ln"] == 0.0
    assert runs["SP not summed over tp"]["copies"]["ln"] > lr / 2
    clip = one_process(STEPS, MAX_NORM)
    divergence, equals_one_process = cells["divergence"], cells["equals_one_process"]
    adamw, norm = tolerance.adamw_weights(STEPS, cells["LR"]), tolerance.gradient(n=8)
    equals_one_process(runs["right"], clip, STEPS, "right")  # asserts the losses and the weights
    assert all(norm.allows(a - c, c) and norm.allows(b - c, c)
               for (a, b), c in zip(runs["right"]["norms"], clip["norms"]))
    # clipped under ZeRO-1: the norm over the reduced shards, the weights one process's
    equals_one_process(runs["right, ZeRO-1"], clip, STEPS, "right, ZeRO-1")
    assert all(norm.allows(a - c, c) for (a, _), c in zip(runs["right, ZeRO-1"]["norms"], clip["norms"]))
    # fp16: the inf on one rank skips step 0 on every rank, the scale halves, then as one process
    fp16 = one_process(STEPS, MAX_NORM, fp16=True, overflow_at=0)
    assert fp16["skipped"] == [True, False] and fp16["scales"] == [2.0 ** 11] * 2
    assert all(r["fp16, overflow"]["skipped"] == fp16["skipped"] for r in ranks)
    assert all(r["fp16, overflow"]["scales"] == fp16["scales"] for r in ranks)
    equals_one_process(runs["fp16, overflow"], fp16, STEPS, "fp16, overflow", torch.float16)

    for name in ("SP not summed over tp", "tied copies drift", "replicated counted tp times"):
        assert divergence(runs[name], clip)[2] > adamw.mean_atol, name  # the mean: beyond rounding
    pp = runs["loss averaged over pp"]
    tolerance.loss().assert_losses([2 * a for a in pp["losses"]], clip["losses"])  # 1/pp of the loss
    adamw.assert_weights(pp["state"], clip["state"])  # training itself is right
    first = {name: runs[name]["norms"][0][0] / clip["norms"][0] for name in MISTAKES}
    assert not norm.allows(first["replicated counted tp times"] - 1, 1)
    assert norm.allows(first["dp averaged twice with ZeRO"] - 0.5, 0.5)  # exactly 1/dp
    assert not norm.allows(first["clip before ZeRO's reduce-scatter"] - 1, 1)
    # the clip and AdamW hide a constant factor: the loss and the mean within a correct run's bounds
    twice = runs["dp averaged twice with ZeRO"]
    tolerance.loss().assert_losses(twice["losses"], clip["losses"])
    assert divergence(twice, clip)[2] < adamw.mean_atol
    # SGD moves each weight by lr times its gradient: even the mean beyond any one weight's bound
    one_sgd = one_process(STEPS, opt_class=sgd)
    assert divergence(runs["ZeRO, SGD"], one_sgd)[2] > tolerance.sgd_weights(STEPS, cells["LR"], n=4).atol


def test_a_redrawn_dropout_mask_changes_the_gradients():
    ns = _namespace("setup", "clinic-dropout", symptoms={})  # the clinic cell's table
    plain = ns["plain"]
    assert ns["symptoms"]["different dropout mask on recompute"]["restored"] == 0.0
    assert all(torch.equal(ns["restored"][n], g) for n, g in plain.items())  # bit for bit
    assert not all(tolerance.gradient().close(ns["redrawn"][n], g) for n, g in plain.items())


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
    assert plain.bubble == 3 / 51  # (p - 1) / (m + p - 1): the same division
    megatron = ParallelConfig(dp=8, tp=8, pp=16, sequence_parallel=False, microbatches=192, precision="fp16")
    # the script's --attention-backend auto: a fused kernel, no s x s scores stored
    meg = estimate(gpt3, megatron, micro_batch=1, global_batch=1536,
                   precision=Precision(param=2, grad=2, optimizer=16), attention="fused")
    gib = 80 * 2**30  # an "80 GB" GPU
    assert meg.fits(gib) and meg.bubble == 15 / 207
    assert meg.model_states.model_states == 20 * meg.params_per_gpu
    assert round(meg.activations / 2**30, 1) == 29.3 and round(meg.total_bytes / 2**30, 1) == 56.5
    assert meg.bytes_per_step["pp"] == 9 * 2**30  # the first stage sends activations only: 192 x 48 MiB
    assert 1024 // 8 == 128 and article.tp * article.pp == 32
    # Megatron's distributed optimizer: fp32 gradients reduce-scattered, bf16 parameters all-gathered
    (_, scatter, _, _), (_, gather, _, _) = zero1.dp_transfers
    assert scatter == 31 / 32 * 4 * zero1.params_per_gpu and gather == scatter / 2
    assert round(zero1.bytes_per_step["dp"] / 2**30) == 30 and zero1.bytes_per_step["pp"] == 288 * 2**20
    # tp with Megatron's backward re-all-gather of the column-parallel inputs (SP): 478 GiB, 671 recomputing
    assert round(zero1.bytes_per_step["tp"] / 2**30) == 478
    ckpt = estimate(gpt3, article.with_(zero_stage=1, activation_checkpointing=True), micro_batch=1,
                    global_batch=1536, precision=megatron_bf16)
    assert round(ckpt.bytes_per_step["tp"] / 2**30) == 671
    ns = _namespace("setup", "gpt3-table", "gpt3-facts", "gpt3-links", "megatron", "megatron-facts")
    assert ns["MEGATRON_FACTS"]["memory_gib"] == meg.total_bytes / 2**30 and ns["MEGATRON_FACTS"]["fits"]
    assert round(ns["MEGATRON_FACTS"]["unfused_gib"], 1) == 79.0  # the unfused estimate it replaces
    assert "sequence-parallel" in _markdown("c43") and "20 bytes" in _markdown("c43")
    assert "attention-backend auto" in _markdown("c43") and "not Megatron's" in _markdown("c11")
    # Megatron recomputes only under --recompute-granularity (TransformerBlock checks it; TransformerConfig
    # requires a method and a number of layers with "full", and ignores them without a granularity);
    # auto lets Transformer Engine pick the kernel
    assert "--recompute-granularity full" in _markdown("gpt3-facts") and "picks the backend" in _markdown("c43")
    assert 0.06 < ns["shares"]["dp"] < 0.065 and ns["shares"]["pp"] < 0.001  # not "a few percent"
    assert round(ns["again"] / 2**30, 1) == 8.0 and round(ns["one_block"] / 2**30, 2) == 0.33


def _markdown(cell_id):
    from notebook_cells import source
    return " ".join(source(NOTEBOOK, cell_id).split())


def test_notebook_ends_with_its_exercises_then_the_appendix_and_has_no_outputs():
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    heads = [c["source"][0].strip() for c in nb["cells"] if c["cell_type"] == "markdown" and c["source"]
             and c["source"][0].startswith("## ")]
    assert heads[-3:] == ["## Summary", "## Exercises",
                          "## Appendix · Going further: ZeRO-3 beside tensor and pipeline parallelism"]
    ids = [c["id"] for c in nb["cells"]]
    assert all(i.startswith("fsdp-") for i in ids[ids.index("appendix") + 1:])  # only the measurements
    assert not any(i.startswith("fsdp-") for i in ids[:ids.index("appendix")])
    assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")


def test_no_code_cell_is_over_25_lines_and_each_follows_its_purpose():
    """Each code cell holds one idea: at most 25 lines, and a markdown cell before it or before
    the run of code cells it belongs to (a definition and its check)."""
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    long = {c["id"]: len("".join(c["source"]).splitlines()) for c in nb["cells"]
            if c["cell_type"] == "code" and len("".join(c["source"]).splitlines()) > 25}
    assert not long, long
    run = 0
    for c in nb["cells"]:
        run = run + 1 if c["cell_type"] == "code" else 0
        assert run <= 4, c["id"]


def test_the_student_forms_the_embedding_group_and_sees_the_copies_drift():
    from notebook_cells import source
    mine = source(NOTEBOOK, "my-embedding-group")
    assert "dist.new_group" in mine and "build_embedding_group" not in mine
    assert "my_embedding_group(mesh)" in source(NOTEBOOK, "my-pipeline")
    assert "build_embedding_group" not in source(NOTEBOOK, "my-pipeline")
    drift = source(NOTEBOOK, "tied-drift")
    assert 'mine["copies"] == dict(tied=0.0, ln=0.0)' in drift and 'unsummed["copies"]["tied"] > LR' in drift


def test_the_claims_behind_the_embedding_group_and_the_drift():
    """Step 3: new_group's documentation requires every process to enter it, in one order (the
    pinned PyTorch's docstring). Step 4: AdamW's first update moves a weight by lr times its
    gradient's sign (bias correction makes m / sqrt(v) = g / |g|, up to eps), so two copies
    whose gradients differ in sign part by 2 lr in one step, and a copy with no gradient (0)
    stays while the other moves by lr."""
    doc = " ".join(torch.distributed.new_group.__doc__.split())
    assert "all processes in the main group" in doc and "even if they are not going to be members" in doc
    assert "groups should be created in the same order in all processes" in doc
    assert "documentation requires that **every** process enter it" in _markdown("c08")
    lr = 3e-3
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([w], lr=lr, weight_decay=0.0)
    w.grad = torch.tensor([2.0, -0.5, 1e-3, 0.0])
    opt.step()
    assert torch.allclose(w.detach(), torch.tensor([-lr, lr, -lr, 0.0]), rtol=1e-4, atol=0)
    assert "lr times its gradient's sign" in _markdown("c15b") and "`2 LR` apart" in _markdown("c15b")
