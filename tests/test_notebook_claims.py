"""Numbers and conventions the prose of notebooks 00 to 05 states, checked against the
functions the notebooks compute them with and against measurements.

* 00: the ring's chunk convention (after the reduce-scatter phase rank i owns chunk
  (i + 1) % N, the homework's convention), run from the notebook's own cell on 3 and 4
  ranks; the latency term 2(N-1) alpha against N and where it overtakes the bandwidth
  term (N = n beta / alpha: about 105 ranks for 25 MiB, about 4 for 1 MiB on the
  InfiniBand figures), both terms growing below it (1.98 ms on 8 ranks, 2.65 ms on 32).
* 01: the data-parallel walls quoted for GPT-2 XL and GPT-3 6.7B.
* 02: the 65B "480 GB -> 320 GB" analysis with the optimizer offloaded to the CPU (only the
  fp16 weights on the GPUs: 2 bytes per parameter).
* 04: the stored bytes of a micro-batch on the middle ranks (about 17 times the input,
  16 without the output this executor keeps; checkpointing divides GPipe's peak by about
  six), interleaving's memory on rank 0 (1 + (p-1)/(pv) times 1F1B's), and the balance of the cuts into
  stages: an embedding-only stage computes nothing, the head's stage stores the
  log-probabilities, time and memory prefer different cuts; the 65B "480 GB -> 320 GB"
  claim computed with `estimate` on its configuration (ZeRO-3, tp 8 x pp 8 x dp 2, with and
  without an embedding stage): not a GPU's, a node's or the job's peak.

The balance loss's range (05) is in test_expert_parallel_claims.py; the stored-bytes
formula against the executor's measurement on every rank in test_pipeline_measured.py;
ZeRO-2's saving at the peak of a step (02) in test_zero_peak.py.
"""
import json
from pathlib import Path

import pytest
import torch

from reference.comms import CostModel
from reference.data import synthetic_batch
from reference.memory import Precision, model_state_bytes
from reference.model import GPT, GPTConfig
from reference.pipeline_parallel import build_schedule, split_stages, stage_costs, stage_flops_formula, stored_bytes_formula
from reference.runtime import launch

ROOT = Path(__file__).resolve().parents[1]


def _cell(notebook: str, cell_id: str) -> str:
    nb = json.loads((ROOT / "notebooks" / notebook).read_text(encoding="utf-8"))
    (cell,) = [c for c in nb["cells"] if c.get("id") == cell_id]
    return "".join(cell["source"])


# ---------------------------------------------------------------------------
# 00: the ring's chunk convention, from the notebook's own code
# ---------------------------------------------------------------------------
def _ring_body(source):
    import torch.distributed as dist

    namespace = {"torch": torch, "dist": dist}
    exec(source, namespace)  # the notebook's exchange and my_ring_all_reduce
    n, i = dist.get_world_size(), dist.get_rank()
    x = torch.full((2 * n + 1,), float(10 ** i))  # uneven chunks: sizes 3, 2, 2 ... on n ranks
    snapshots = []
    namespace["my_ring_all_reduce"](x, snapshots)
    return [(label, [c.clone() for c in chunks]) for label, chunks in snapshots], x


@pytest.mark.parametrize("world", [3, 4])
def test_ring_convention_rank_i_owns_chunk_i_plus_1(world):
    source = _cell("00_distributed_primer.ipynb", "db3aa25b")
    total = float(sum(10 ** r for r in range(world)))
    for i, (snapshots, x) in enumerate(launch(_ring_body, world, source, timeout=60, quiet=True)):
        label, chunks = snapshots[world - 1]  # start, then N - 1 reduce-scatter steps
        assert label == f"reduce-scatter step {world - 1}"
        complete = [c for c, chunk in enumerate(chunks) if torch.all(chunk == total)]
        assert complete == [(i + 1) % world], (i, chunks)  # exactly chunk (i + 1) % N is summed
        assert torch.all(x == total)  # and the all-gather finishes the all-reduce


# ---------------------------------------------------------------------------
# 00: the latency term against the number of ranks
# ---------------------------------------------------------------------------
def test_latency_term_grows_in_proportion_to_ranks():
    ib = CostModel.infiniband()
    for n in (2, 8, 32, 128, 1024):
        assert ib.time("all_reduce", 0, n) == pytest.approx(2 * (n - 1) * ib.alpha, rel=1e-12)
    # the bandwidth term of 25 MiB hardly moves between 32 and 1024 ranks, the latency term x 33
    bandwidth = [ib.time("all_reduce", 25 * 2**20, n) - ib.time("all_reduce", 0, n) for n in (32, 1024)]
    assert bandwidth[1] / bandwidth[0] < 1.04
    assert ib.time("all_reduce", 0, 1024) / ib.time("all_reduce", 0, 32) == pytest.approx(1023 / 31)


@pytest.mark.parametrize("nbytes, quoted", [(25 * 2**20, 105), (2**20, 4)])
def test_latency_overtakes_bandwidth_at_n_beta_over_alpha(nbytes, quoted):
    ib = CostModel.infiniband()
    crossover = nbytes * ib.beta / ib.alpha
    assert round(crossover) == quoted  # what the notebook prints and its prose quotes

    def latency_wins(n):
        latency = ib.time("all_reduce", 0, n)
        return latency > ib.time("all_reduce", nbytes, n) - latency

    below, above = int(crossover), int(crossover) + 1
    assert not latency_wins(below) and latency_wins(above)


def test_both_terms_grow_below_the_crossover():
    # "1.98 ms on 8 ranks and 2.65 ms on 32": slower with more ranks well before the crossover
    ib, bucket = CostModel.infiniband(), 25 * 2**20
    t8, t32 = (ib.time("all_reduce", bucket, n) for n in (8, 32))
    assert (round(t8 * 1e3, 2), round(t32 * 1e3, 2)) == (1.98, 2.65)
    for n in (8, 32):
        latency = ib.time("all_reduce", 0, n)
        assert latency < ib.time("all_reduce", bucket, n) - latency        # below the crossover
    assert round(100 * ib.time("all_reduce", 0, 32) / t32) == 23           # "23 %" latency at 32 ranks
    for a, b in zip((2, 8, 32, 105), (8, 32, 105, 1024)):                   # both terms grow at every N
        assert ib.time("all_reduce", 0, a) < ib.time("all_reduce", 0, b)
        assert (ib.time("all_reduce", bucket, a) - ib.time("all_reduce", 0, a)
                < ib.time("all_reduce", bucket, b) - ib.time("all_reduce", 0, b))


# ---------------------------------------------------------------------------
# 01: why data parallelism alone stops scaling
# ---------------------------------------------------------------------------
def _psi(n_layer, n_embd, n_head, block_size):
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=50257, block_size=block_size, n_layer=n_layer, n_head=n_head,
                             n_embd=n_embd)).num_parameters()


def test_data_parallel_walls_quoted_in_notebook_01():
    xl, gpt3_6b = _psi(48, 1600, 25, 1024), _psi(32, 4096, 32, 2048)
    assert round(xl / 1e9, 1) == 1.6 and round(gpt3_6b / 1e9, 1) == 6.7
    assert round(16 * xl / 1e9) == 25 and round(16 * gpt3_6b / 1e9) == 107   # "25 GB", "107 GB"
    assert 16 * xl < 80e9 < 16 * gpt3_6b                                    # fits / does not fit 80 GB
    n, ib = 64, CostModel.infiniband()
    assert round(2 * (n - 1) / n * 4 * xl / 1e9) == 12                       # "12 GB" sent per step
    assert 0.45 < ib.time("all_reduce", 4 * xl, n) < 0.55                   # "half a second"
    assert round(GPT(GPTConfig.small()).num_parameters() / 1e6, 1) == 0.8    # "about 0.8 M parameters"


# ---------------------------------------------------------------------------
# 02: the 65B claim with the optimizer offloaded to the CPU
# ---------------------------------------------------------------------------
PSI_65B = 65_000_000_000


def _on_all_gpus(dp, stage, precision=Precision.mixed_adam_offload()):
    return dp * model_state_bytes(PSI_65B, dp, stage, precision).model_states


def test_offload_leaves_only_the_weights_on_the_device():
    # ZeRO-Offload steps the optimizer on the CPU: the reduced gradients go there too.
    p = Precision.mixed_adam_offload()
    assert (p.param, p.grad, p.optimizer) == (2, 0, 0)
    mixed = Precision.mixed_adam()
    assert mixed.param + mixed.grad + mixed.optimizer == 16 and mixed.grad + mixed.optimizer == 14   # what moves


def test_65b_readings_with_offload():
    gb = lambda dp, stage, **kw: round(_on_all_gpus(dp, stage, **kw) / 1e9, 6)
    assert gb(1, 0, precision=Precision.mixed_adam()) == 1040 > 2 * 480    # without offload: > 2 x 480 GB
    for dp in (1, 2, 3, 4, 8, 64):
        assert gb(dp, 3) == 130                                           # ZeRO-3: 2 Psi, whatever N
        assert gb(dp, 2) == 130 * dp                                      # ZeRO-2: 2 N Psi
    assert 320 - gb(2, 3) == 190                                          # "about 190 GB" beside ZeRO-3's
    cuts = {dp: gb(dp, 2) - gb(dp, 3) for dp in (2, 3)}                   # 2 (N - 1) Psi
    assert cuts == {2: 130, 3: 260} and cuts[2] < 160 < cuts[3]           # the article's 160 GB in between
    assert 160 - cuts[2] < cuts[3] - 160                                  # nearer 2 ranks
    assert gb(2, 3) * 2 == gb(2, 2)                                       # the model states halve, not 2/3
    assert (480 - gb(2, 2), 320 - gb(2, 3)) == (220, 190)                 # 30 GB of the cut not model states
    assert 320e9 > 288e9                                # more than any one accelerator (2025: MI355X, B300, 288 GB)
    embedding = 32_000 * 8192
    assert round(embedding / 1e9, 2) == 0.26 and round(100 * embedding / PSI_65B, 1) == 0.4
    assert round(2 * embedding / 1e9, 2) == 0.52                         # "0.52 GB" of fp16 weights on the GPUs


# ---------------------------------------------------------------------------
# 04: what a micro-batch stores, and the two balances of a cut into stages
# ---------------------------------------------------------------------------
MEM_CFG = GPTConfig.tiny(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=64)
VOCAB_CFG = GPTConfig.tiny(n_layer=6, n_embd=32, vocab_size=1024)


def test_middle_stage_stores_17_inputs_and_checkpointing_divides_by_six():
    spec = split_stages(GPT.from_config_seed(MEM_CFG, 0), 4)[1].spec       # block 1 alone
    parts = stored_bytes_formula(MEM_CFG, 1, spec)
    S = 1 * 8 * 16 * 4
    assert parts == {"1 block(s), 16S + 4s + ℓ each": 16 * S + 4 * 8 * 4 + 2 * 8 * 4,
                     "output kept for its gradient, S": S}
    a, input_bytes = sum(parts.values()), S
    assert (a, input_bytes) == (8896, 512) and round(a / input_bytes) == 17
    # the kept output is this executor's: freed after the send (as Megatron-LM does), about 16
    assert round((a - parts["output kept for its gradient, S"]) / input_bytes) == 16
    recompute = a - input_bytes - S                                        # a' leaves out input and output
    m = 8
    assert round(m * a / (m * input_bytes + recompute)) == 6               # GPipe's peak, checkpointed


@pytest.mark.parametrize("pp, m", [(4, 8), (4, 16), (2, 8), (8, 16)])
def test_interleaving_holds_1_plus_p_minus_1_over_pv_times_1f1b(pp, m):
    # rank 0 holds pv + p - 1 (micro-batch, chunk) pairs of 1/v stage each, against 1F1B's p stages
    assert build_schedule("1f1b", pp, m).peak_in_flight(0) == pp
    for v in (2, 4):
        held = build_schedule("interleaved", pp, m, v).peak_in_flight(0)
        assert held == pp * v + pp - 1
        assert held / v / pp == 1 + (pp - 1) / (pp * v)
    assert build_schedule("interleaved", 4, 8, 2).peak_in_flight(0) / 2 / 4 == 1.375   # "1.375 times"


def _vocab_costs():
    model = GPT.from_config_seed(VOCAB_CFG, 0)
    idx, targets = synthetic_batch(1, VOCAB_CFG.block_size, VOCAB_CFG.vocab_size, seed=0)
    cuts = {"by layers": {}, "embedding alone": dict(embedding_stage=True), "head alone": dict(head_stage=True),
            "embedding and head alone": dict(embedding_stage=True, head_stage=True),
            "balanced by parameters": dict(balance="params")}
    return {k: stage_costs(split_stages(model, 4, **kw), idx, targets) for k, kw in cuts.items()}


def test_stage_costs_equal_their_formulas_and_the_balances_differ():
    costs = _vocab_costs()
    time_ratio, memory_ratio = {}, {}
    for label, stages in costs.items():
        for c in stages:
            assert c.flops == stage_flops_formula(VOCAB_CFG, 1, c.spec)
            assert c.stored_bytes == sum(stored_bytes_formula(VOCAB_CFG, 1, c.spec).values())
        flops = [c.flops for c in stages]
        held = [16 * c.params + min(8, 4 - r) * c.stored_bytes for r, c in enumerate(stages)]
        time_ratio[label], memory_ratio[label] = max(flops) / (sum(flops) / 4), max(held) / (sum(held) / 4)
    assert costs["embedding alone"][0].flops == 0                          # a lookup: nearly idle
    assert costs["embedding alone"][0].params > 2 * costs["by layers"][1].params   # yet more than 2 blocks
    assert time_ratio["embedding alone"] == time_ratio["by layers"]
    assert min(time_ratio, key=time_ratio.get) == "head alone"
    assert min(memory_ratio, key=memory_ratio.get) in ("embedding and head alone", "balanced by parameters")
    assert [c.spec for c in costs["balanced by parameters"]] == [c.spec for c in costs["embedding and head alone"]]
    head = costs["head alone"][-1]
    logprobs = VOCAB_CFG.block_size * VOCAB_CFG.vocab_size * 4
    assert head.stored_bytes == max(c.stored_bytes for c in costs["head alone"]) and head.stored_bytes > logprobs


# ---------------------------------------------------------------------------
# 04: the 65B claim on the configuration it names, with the cost model
# ---------------------------------------------------------------------------
def _emb65():
    """The notebook's own cells (the table and its claims) run on the setup's names: the
    namespace they leave."""
    from reference.parallel import ParallelConfig
    from reference.parallel.estimate import estimate
    from reference.pipeline_parallel import plan_stages

    namespace = dict(GPTConfig=GPTConfig, ParallelConfig=ParallelConfig, estimate=estimate,
                     Precision=Precision, plan_stages=plan_stages)
    for cell_id in ("emb65-table", "emb65-table2", "emb65-facts"):
        exec(_cell("04_pipeline_parallel.ipynb", cell_id), namespace)
    return namespace


def test_65b_embedding_stage_claims_of_notebook_04(capsys):
    from reference.parallel import ParallelConfig
    from reference.parallel.estimate import estimate

    nb = _emb65()
    printed = capsys.readouterr().out
    model, psi = nb["LLAMA_65B"], nb["PSI_65B"]
    assert round(psi / 1e9, 1) == 65.0 and abs(psi / 65.2e9 - 1) < 0.01     # LLaMA-65B: 65.2B
    layout = ParallelConfig(dp=2, tp=8, pp=8, zero_stage=3, sequence_parallel=True, microbatches=32,
                            activation_checkpointing=True, precision="bf16")
    cuts = [layout, layout.with_(embedding_stage=True), layout.with_(pp=10, embedding_stage=True)]
    rows = []
    for config in cuts:  # every pipeline rank's peak, without the notebook's helper
        peaks = [estimate(model, config, micro_batch=1, global_batch=64, stage=r).total_bytes / 1e9
                 for r in range(config.pp)]
        rows.append((max(peaks), peaks, 16 * sum(peaks)))
    before, emb, emb10 = nb["EMB65"].values()
    for (gpu, peaks, job), got in zip(rows, (before, emb, emb10)):
        assert got["gpu"] == pytest.approx(gpu, rel=1e-12) and got["node"] == pytest.approx(8 * gpu)
        assert got["job"] == pytest.approx(job, rel=1e-12)
    # per GPU: +33 % at the same depth (14 blocks instead of 10), -3 % with two more stages;
    # at most down to the next stage's peak; far below any GPU's memory
    assert (round(before["gpu"], 1), round(emb["gpu"], 1), round(emb10["gpu"], 1)) == (13.3, 17.6, 12.8)
    assert (emb["blocks"], before["blocks"]) == (14, 10) and emb10["gpus"] == 160
    assert round(emb["gpu"] / before["gpu"] - 1, 2) == 0.33 and round(emb10["gpu"] / before["gpu"] - 1, 2) == -0.03
    assert emb10["gpu"] >= rows[0][1][1] == before["second"] and round(before["second"], 1) == 12.8
    assert max(r[0] for r in rows) < 141 < 320                        # an H200's 141 GB
    # per node: 106 -> 141 (103 at 10 stages), up at the same depth, nowhere near 480 or 320
    assert [round(r["node"]) for r in (before, emb, emb10)] == [106, 141, 103]
    assert max(r["node"] for r in (before, emb, emb10)) < 320 / 2
    # the whole job: +0.2 %; its model states 16 bytes a parameter (LayerNorms replicated over
    # tp add 0.2 %) beside each replica's stages whole, 2 x (2 + 2) bytes a parameter
    assert round(emb["job"] / before["job"] - 1, 3) == 0.002 and [round(r["job"]) for r in (before, emb)] == [1634, 1637]
    for r in (before, emb, emb10):
        assert 16 < r["states"] * 1e9 / psi < 16.05 and round(r["states"]) == 1041 > 2 * 480
        assert 8 < r["whole"] * 1e9 / psi < 8.05 and round(r["whole"]) == 521
    assert [round(r["job"]) for r in list(nb["OFFLOADED"].values())[:2]] == [790, 790]  # offloaded: > 480
    assert "13.3 -> 12.8 GB" in printed and "1,634 -> 1,637 GB (+0.2%)" in printed and "790 -> 790 GB" in printed


# ---------------------------------------------------------------------------
# The two pictures these claims are drawn with
# ---------------------------------------------------------------------------
def test_plot_latency_vs_ranks_draws_both_terms():
    from reference.viz import plot_latency_vs_ranks

    ib, ranks = CostModel.infiniband(), [2, 8, 32, 1024]
    fig = plot_latency_vs_ranks(ib, [25 * 2**20, 2**20], ranks, mark=32)
    ax = fig.axes[0]
    latency, big, small = (line.get_ydata() for line in ax.lines[:3])
    assert list(latency) == pytest.approx([2 * (n - 1) * ib.alpha for n in ranks])
    assert list(small) == pytest.approx([2 * (n - 1) / n * 2**20 * ib.beta for n in ranks])
    assert big[-1] < latency[-1] and big[0] > latency[0]          # they cross for 25 MiB
    assert fig._repr_png_().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="ranks"):
        plot_latency_vs_ranks(ib, [1e6], [1, 2])


def test_plot_stage_balance_one_row_per_cut():
    from reference.pipeline_parallel import plot_stage_balance

    costs = {k: v for k, v in _vocab_costs().items() if k in ("by layers", "head alone")}
    fig = plot_stage_balance(costs, pp=4, m=8)
    assert len(fig.axes) == 4
    time_bars = [p.get_width() for p in fig.axes[0].patches]
    assert time_bars == pytest.approx([c.flops / 1e6 for c in costs["by layers"]])
    memory_bars = [p.get_width() for p in fig.axes[1].patches]     # states, then activations at the 1F1B peak
    stages = costs["by layers"]
    assert memory_bars == pytest.approx([16 * c.params / 1e6 for c in stages]
                                        + [min(8, 4 - r) * c.stored_bytes / 1e6 for r, c in enumerate(stages)])
