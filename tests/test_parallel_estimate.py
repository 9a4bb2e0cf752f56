"""The cost formulas of `reference.parallel.estimate` against the tiny model's real numbers,
the article's 175B configuration analysed with them, and the step time built on them.

Measured on gloo ranks: parameters per stage, bytes per link (`reference.comms.meter`: tp with
and without SP, recompute and MoE layers; dp for every ZeRO stage, ZeRO-3's rows over dp and
over dp / ep with experts, resharding after forward), model states (`reference.memory.measure`)
exactly; the step's peak (every tensor alive, as `tests/test_composed_peak.py` counts it)
within a stated band."""
import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.parallel.config import ParallelConfig
from reference.parallel.estimate import (H100_BF16_PEAK, Hardware, activation_bytes_per_block, block_params,
                                         estimate, link_of, stage_params, step_time)
from reference.profile import training_flops
from reference.runtime import launch

CFG = GPTConfig.tiny(n_layer=4, block_size=16)
GPT3 = GPTConfig(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, n_embd=12288)


def test_block_and_model_parameter_counts():
    model = GPT(CFG)
    block = sum(p.numel() for p in model.h[0].parameters())
    assert block_params(CFG.n_embd, CFG.d_ff) == block == 12 * 32 ** 2 + 13 * 32
    whole = ParallelConfig()
    assert stage_params(CFG, whole, 0) == sum(p.numel() for p in model.parameters())
    # GPT-3: 96 (12 h^2 + 13 h) + V h + s h + 2 h = 174.6B
    assert stage_params(GPT3, whole, 0) == pytest.approx(174.6e9, rel=1e-3)


def test_activation_formulas_are_the_papers():
    s, b, h, a = 2048, 1, 12288, 96
    assert activation_bytes_per_block(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    sp = activation_bytes_per_block(s, b, h, a, tp=8, sequence_parallel=True)
    no_sp = activation_bytes_per_block(s, b, h, a, tp=8)
    assert sp < no_sp < activation_bytes_per_block(s, b, h, a)
    assert activation_bytes_per_block(s, b, h, a, 8, True, "full") == 2 * s * b * h / 8


def test_activations_scale_with_their_bytes_and_the_masks_stay_one_byte():
    """The paper's 34 s b h + 5 a s^2 b is 16 two-byte activations and 2 one-byte dropout masks
    per token and channel, 2 two-byte scores and 1 mask per score: in fp32 (4 bytes) 66 and 9.
    `estimate` takes the activation bytes from the precision unless told."""
    s, b, h, a = 16, 2, 32, 4
    fp32 = dict(act_bytes=4)
    assert activation_bytes_per_block(s, b, h, a, **fp32) == s * b * h * 66 + a * s * s * b * 9
    assert activation_bytes_per_block(s, b, h, a, 2, **fp32) == s * b * h * (18 + 48 / 2) + a * s * s * b * 9 / 2
    assert activation_bytes_per_block(s, b, h, a, 2, True, **fp32) == (s * b * h * 66 + a * s * s * b * 9) / 2
    assert activation_bytes_per_block(s, b, h, a, 2, True, "full", **fp32) == 4 * s * b * h / 2
    # a fused attention kernel keeps a log-sum-exp (fp32) per head and token, not the scores
    assert activation_bytes_per_block(s, b, h, a, attention="fused", **fp32) == s * b * h * 66 + 4 * a * s * b
    cfg = GPTConfig.tiny(n_layer=4, block_size=16)
    fp32_run, bf16_run = (estimate(cfg, ParallelConfig(dp=4, precision=p), micro_batch=2, global_batch=8)
                          for p in ("fp32", "bf16"))
    head = 4 * 16 * 2 * 256  # the loss's fp32 log-probabilities, in either precision
    assert fp32_run.activations == 4 * activation_bytes_per_block(16, 2, 32, 4, act_bytes=4) + head
    assert bf16_run.activations == 4 * activation_bytes_per_block(16, 2, 32, 4) + head


def test_an_moe_layer_stores_what_its_formula_counts():
    """`moe_activation_bytes` against what autograd saves in one `MoE` forward (distinct
    storages, parameters left out; `SavedTensorBytes`), no token dropped: renormalised top-2
    to top-4 and Switch's raw top-1, one and several sequences (a group each). The router's fp32
    numbers, the int64 choices and the combine's weighted copy are 234 of the 1578 bytes a
    token stores in the first case."""
    from reference.context_parallel.measure import SavedTensorBytes
    from reference.expert_parallel import MoE
    from reference.parallel.estimate_memory import moe_activation_bytes

    torch.manual_seed(0)
    for b, s, h, d_ff, n_experts, k in [(1, 8, 16, 64, 4, 2), (3, 8, 16, 64, 8, 2), (2, 8, 16, 64, 4, 1),
                                        (2, 5, 32, 64, 4, 2), (4, 16, 8, 24, 6, 4)]:
        layer = MoE(h, d_ff, n_experts, k, capacity_factor=None)
        with SavedTensorBytes(exclude=layer.parameters()) as saved:
            layer(torch.randn(b, s, h, requires_grad=True))
        assert saved.bytes == moe_activation_bytes(s, b, h, d_ff, k, 4, n_experts=n_experts), (b, s, k)


def test_the_article_175b_configuration():
    """DP 32 x TP 8 x PP 4, bf16 mixed Adam, 1536 sequences of 2048 tokens, micro-batch 1:
    without ZeRO the first stage's model states alone (16 bytes x 5.5B) exceed 80 GB."""
    base = ParallelConfig.article_175b().with_(zero_stage=0, activation_checkpointing=False)
    rows = {}
    for zero in (0, 1):
        for ckpt in (False, True):
            e = estimate(GPT3, base.with_(zero_stage=zero, activation_checkpointing=ckpt),
                         micro_batch=1, global_batch=1536)
            rows[(zero, ckpt)] = e
    assert rows[(0, False)].params_per_gpu == pytest.approx(5.54e9, rel=0.01)
    assert rows[(0, False)].model_states.model_states == pytest.approx(89e9, rel=0.01)
    assert not rows[(0, True)].fits()
    assert rows[(1, False)].model_states.model_states == pytest.approx(24e9, rel=0.03)
    assert rows[(1, False)].activations == pytest.approx(34e9, rel=0.03)  # 4 micro-batches held
    assert rows[(1, True)].activations < 1e9
    sent = rows[(1, False)].bytes_per_step
    assert sent["tp"] > 100e9 and sent["tp"] > 10 * (sent["dp"] + sent["pp"])
    assert rows[(1, False)].fits() and rows[(1, True)].memory_gb < rows[(1, False)].memory_gb
    assert rows[(0, False)].bubble == pytest.approx(3 / (48 + 3))


def _measure(configs):
    from reference import comms
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step

    out = []
    for config in configs:
        torch.manual_seed(0)
        mesh = config.mesh().build_groups()
        pm = parallelize(GPT(CFG), mesh, config)
        opt = pm.make_optimizer(torch.optim.SGD, lr=0.1)
        idx = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
        with comms.meter() as m:
            train_step(pm, opt, idx, idx)
        sent = {dim: m.sent_bytes(op, group=comms.group_label(mesh.group(dim)))
                for dim, op in (("dp", "all_reduce"), ("pp", "send")) if getattr(mesh, dim) > 1}
        if config.zero_stage and mesh.dp > 1:  # ZeRO's own collectives (the all-reduce: the loss)
            sent["zero"] = sum(m.sent_bytes(op, group=comms.group_label(mesh.group("dp")))
                               for op in ("reduce_scatter", "all_gather"))
        out.append((mesh.pp_rank, sum(p.numel() for p in pm.parameters()), sent))
    return out


@pytest.mark.parametrize("world_size, configs", [
    (4, [ParallelConfig(dp=2, pp=2, microbatches=2), ParallelConfig(tp=2, pp=2, microbatches=2),
         ParallelConfig(dp=2, tp=2),
         # ZeRO-2 and ZeRO-3 accumulating over 2 micro-batches: they communicate per micro-batch
         ParallelConfig(dp=4, zero_stage=2, microbatches=2), ParallelConfig(dp=4, zero_stage=3, microbatches=2),
         # FSDP by blocks recomputed: each block gathered once more per micro-batch
         ParallelConfig(dp=4, zero_stage=3, microbatches=2, activation_checkpointing=True)]),
    (8, [ParallelConfig.debug_3d()]),
])
def test_parameters_and_bytes_per_rank_match_the_formulas(world_size, configs):
    ranks = launch(_measure, world_size, configs, timeout=300)
    for i, config in enumerate(configs):
        b = 8 // (config.dp * config.microbatches)
        e = estimate(CFG, config, micro_batch=b, global_batch=8, precision=None, act_bytes=4,
                     grad_bytes=4)
        for pp_rank, n_params, sent in (r[i] for r in ranks):
            d = config.dp
            if config.zero_stage:  # ZeRO-3 holds shards; ZeRO-2's dp traffic grows with m
                assert sent["zero"] == e.bytes_per_step["dp"], config
                continue
            assert n_params == stage_params(CFG, config, pp_rank), config
            if config.dp > 1:  # the gradients' all-reduce, 2 (d-1)/d x 4 bytes x params, and
                # the loss's (4 bytes) to make it the global mean
                assert sent["dp"] == 2 * (d - 1) / d * 4 * n_params + 2 * (d - 1) / d * 4
            if config.pp > 1:  # one activation or one gradient per micro-batch, S each
                S = b * 16 * CFG.n_embd * 4 // (config.tp if config.sequence_parallel else 1)
                assert sent["pp"] == config.microbatches * S == e.bytes_per_step["pp"]
            if config.dp > 1 and pp_rank == 0:
                assert sent["dp"] - 2 * (d - 1) / d * 4 == e.bytes_per_step["dp"]
        assert e.params_per_gpu == stage_params(CFG, config, 0)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_traffic_is_charged_per_micro_batch(zero):
    """Accumulating over m micro-batches (pp = 1), per GPU and step, P parameters, g = 2 bytes:
    ZeRO-0/1 reduce once, 2 (d-1)/d P g; ZeRO-2 reduce-scatters after every micro-batch's
    backward and all-gathers once, (m + 1) (d-1)/d P g; ZeRO-3 all-gathers forward and
    backward and reduce-scatters in every micro-batch, 3 m (d-1)/d P g."""
    d = 16
    model = GPTConfig(vocab_size=50257, block_size=2048, n_layer=24, n_head=32, n_embd=2048)
    got, want = {}, {}
    for m in (1, 2, 4, 8):
        e = estimate(model, ParallelConfig(dp=d, zero_stage=zero, microbatches=m, precision="bf16"),
                     micro_batch=1, global_batch=d * m)
        once = (d - 1) / d * e.params_per_gpu * 2
        got[m] = e.bytes_per_step["dp"]
        want[m] = {0: 2 * once, 1: 2 * once, 2: (m + 1) * once, 3: 3 * m * once}[zero]
    assert got == pytest.approx(want, rel=1e-12)
    assert e.microbatches == 8  # what step_time divides the compute by
    assert sum(b * n for _, b, n, _ in e.dp_transfers) == pytest.approx(want[8], rel=1e-12)


def test_composed_zero3_gathers_once_per_step_and_holds_the_stage():
    """ZeRO-3 with tp, pp or recompute shards each tensor and keeps the stage gathered through
    the step: 2 (d-1)/d P g per step whatever m (one all-gather, one reduce-scatter), and the
    stage's parameters and gradients held whole during the step. On the tiny model at dp 4 x
    tp 2 each transfer is (d-1)/d x 4 x 30,464 = 91,392 bytes, what tests/test_fsdp_composed.py
    measures on 8 ranks."""
    cfg = GPTConfig.tiny(n_layer=4, block_size=16)
    for m in (1, 2, 4):
        e = estimate(cfg, ParallelConfig(dp=4, tp=2, zero_stage=3, microbatches=m), micro_batch=2,
                     global_batch=8 * m)
        assert e.params_per_gpu == 30_464
        assert [b for _, b, n, _ in e.dp_transfers] == [91_392, 91_392]
        assert e.bytes_per_step["dp"] == 2 * 91_392
        assert e.held_in_step == 30_464 * (4 + 4)  # fp32 parameters and gradients
        assert set(e.phases) == {"gather", "pipeline", "reduce-scatter"}
        assert e.total_bytes == max(e.phases.values())          # the step peaks in its largest phase
        # AdamW's moments of the shard (S = P / 4 here) throughout; gathering: the shards twice
        # (packed), the (N, S) received, P whole, and the largest tensor padded (wte, 128 x 32)
        S, P, wte = 30_464 // 4, 30_464, 128 * 32
        assert e.phases["gather"] == 8 * S + 4 * (2 * S + 4 * S + P + wte)
        # reduce-scattering: the stage and its gradients whole, the (N, S) buffer, the largest
        # shard (wte's 32 rows) and the 4-byte loss
        assert e.phases["reduce-scatter"] == 8 * S + 8 * P + 4 * (4 * S + wte // 4) + 4
    flat = estimate(cfg, ParallelConfig(dp=4, zero_stage=3, microbatches=4), micro_batch=2, global_batch=32)
    assert flat.held_in_step == 0 and len(flat.dp_transfers) == 1  # blocks gathered per micro-batch
    assert set(flat.phases) == {"step"}


def test_step_time_is_compute_exposed_communication_and_bubble():
    """dp 16 (two nodes: the gradients cross them) with ZeRO-0 and m = 4; then the same
    GPUs as tp 8 x pp 2: tp on NVLink, pp across nodes, the bubble (pp-1)/m of the busy time."""
    model = GPTConfig(vocab_size=50257, block_size=2048, n_layer=24, n_head=32, n_embd=2048)
    hw = Hardware()
    assert hw.peak_flops == H100_BF16_PEAK and hw.intra.bandwidth == 450e9 and hw.inter_bandwidth == 50e9
    n = stage_params(model, ParallelConfig(), 0)
    flops = training_flops(n, 64 * 2048, 24, 2048, 2048)
    e = estimate(model, ParallelConfig(dp=16, precision="bf16"), micro_batch=1, global_batch=64)
    t = step_time(e)
    compute = flops / 16 / H100_BF16_PEAK
    backward = compute / 4 * 2 / 3  # one micro-batch's backward: the all-reduce hides under it
    assert t["compute"] == pytest.approx(compute)
    assert t["dp"] == pytest.approx(max(0.0, 2 * 15 / 16 * n * 2 / 50e9 - backward)) and t["dp"] > 0
    assert t["tp"] == t["pp"] == t["bubble"] == 0
    assert t["total"] == pytest.approx(compute + t["dp"])
    # full recompute: a third more compute, and the all-reduce hides under a longer backward
    r = step_time(estimate(model, ParallelConfig(dp=16, precision="bf16", activation_checkpointing=True),
                           micro_batch=1, global_batch=64))
    assert r["compute"] == pytest.approx(4 / 3 * compute) and r["dp"] < t["dp"]

    c = ParallelConfig(tp=8, pp=2, microbatches=64, sequence_parallel=True, precision="bf16")
    assert (link_of(c, "tp"), link_of(c, "pp"), link_of(c, "dp")) == ("intra", "inter", "intra")
    e = estimate(model, c, micro_batch=1, global_batch=64)
    t = step_time(e)
    assert t["tp"] == pytest.approx(e.bytes_per_step["tp"] / 450e9)
    assert t["pp"] == pytest.approx(e.bytes_per_step["pp"] / 50e9)
    assert t["bubble"] == pytest.approx((t["compute"] + t["tp"] + t["pp"]) * 1 / 64)
    assert t["bubble"] / (t["total"]) == pytest.approx(e.bubble)  # (p-1)/(m+p-1) of the step
    assert t["total"] == pytest.approx(sum(t[k] for k in ("compute", "tp", "pp", "dp", "bubble")))


def _held(cases):
    from reference.parallel.parallelize import parallelize

    out = []
    for model, config in cases:
        pm = parallelize(GPT(GPTConfig(**model)), config.mesh().build_groups(), config)
        out.append(sum(p.numel() for p in pm.parameters()))
    return out


def test_stage_params_counts_untied_padded_and_uneven_models():
    """Untied head, a vocabulary tp does not divide (padded), layers pp does not divide,
    3 heads per rank: the formula equals what `parallelize` leaves on each rank."""
    cases = [(dict(vocab_size=81, block_size=12, n_layer=3, n_head=4, n_embd=16, tie_weights=False),
              ParallelConfig(tp=2, pp=2, microbatches=2)),
             (dict(vocab_size=50, block_size=12, n_layer=5, n_head=4, n_embd=16),
              ParallelConfig(tp=2, pp=2, microbatches=2)),
             (dict(vocab_size=97, block_size=12, n_layer=4, n_head=6, n_embd=24),
              ParallelConfig(dp=2, tp=2, microbatches=1)),
             (dict(vocab_size=97, block_size=12, n_layer=4, n_head=6, n_embd=24, tie_weights=False),
              ParallelConfig(dp=4))]
    ranks = launch(_held, 4, cases, timeout=120)
    for i, (model, config) in enumerate(cases):
        mesh = config.mesh()
        want = [stage_params(GPTConfig(**model), config, mesh.coords(r).pp) for r in range(4)]
        assert [r[i] for r in ranks] == want, (model, config)


# ---------------------------------------------------------------------------------------------
# Experts, sequence parallelism and resharding, against the meter and the step's peak
# ---------------------------------------------------------------------------------------------
MOE = 4  # experts per layer, every layer (tests/sweep.py's model)
MEASURED = [  # (config, experts): 4 ranks, BATCH = (16, 16) as tests/test_composed_peak.py
    (ParallelConfig(dp=2, tp=2, sequence_parallel=True, activation_checkpointing=True, microbatches=2), False),
    (ParallelConfig(dp=2, tp=2, ep=2, zero_stage=3, sequence_parallel=True, microbatches=2), True),
    (ParallelConfig(dp=4, ep=2, zero_stage=3, microbatches=2), True),
    (ParallelConfig(dp=2, tp=2, ep=2, sequence_parallel=True, activation_checkpointing=True), True),
    (ParallelConfig(dp=2, tp=2, zero_stage=3, sequence_parallel=True, microbatches=2)
     .with_(reshard_after_forward=True), False),
    (ParallelConfig(dp=2, pp=2, zero_stage=3, microbatches=2).with_(reshard_after_forward=True), False),
]


def _measure_steps(cases):
    """Per case, on every rank: its pipeline rank, model states between steps, bytes sent per
    (group, collective) and the peak bytes of a second step (`test_composed_peak._StepPeak`)."""
    import weakref

    import test_composed_peak as peak_test

    from reference import comms, memory
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step
    from sweep_run import full_batches as batches  # the estimate gives every expert its share
    from sweep_run import model_for
    from sweep import SweepCase

    out = []
    for config, experts in cases:
        mesh = config.mesh().build_groups()
        pm = parallelize(model_for(SweepCase(config, moe=experts)), mesh, config, batch=(16, 16))
        opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
        (x, y), (x2, y2) = batches(2)
        train_step(pm, opt, x, y)  # the optimizer's state exists from here on
        held = memory.measure(pm.parameters(), opt)
        state = [v for o in memory._optimizers(opt) for st in o.state.values()
                 for v in st.values() if isinstance(v, torch.Tensor)]
        before = {}
        for t in list(pm.parameters()) + [p.grad for p in pm.parameters() if p.grad is not None] + state:
            before.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        mon = peak_test._StepPeak(pm, opt, [(weakref.ref(s), s.nbytes()) for s in before.values()])
        del state, before, t
        routed = []  # per MoE forward of the step: rows its experts received - rows it dispatched
        hooks = [m.register_forward_hook(lambda mod, i, o: routed.append(
            int(mod.last_stats.recv_counts.sum() - mod.last_stats.send_counts.sum())))
            for s in pm.stages for m in s.modules() if getattr(m, "ep_size", 1) > 1]
        with comms.meter() as meter, mon:
            train_step(pm, opt, x2, y2)
        mon.before = []
        for h in hooks:
            h.remove()
        labels = {comms.group_label(mesh.group(dim)): dim for dim in ("tp", "dp", "edp")
                  if getattr(mesh, dim) > 1}
        sent = {(labels[r["group"]], r["op"]): r["sent_bytes"] for r in meter.records()
                if r["group"] in labels}
        out.append((mesh.pp_rank, held, sent, mon.peak_bytes, routed))
    return out


@pytest.fixture(scope="module")
def measured():
    return launch(_measure_steps, 4, MEASURED, timeout=300)


def _estimate_of(i, stage):
    config, experts = MEASURED[i]
    # the course's executor keeps a column-parallel layer's gathered input (regather_input=False)
    return estimate(CFG, config, micro_batch=16 // (config.dp * config.microbatches), global_batch=16,
                    stage=stage, n_experts=MOE if experts else None, regather_input=False)


@pytest.mark.parametrize("i", range(len(MEASURED)), ids=[str(c) for c, _ in MEASURED])
def test_bytes_and_model_states_match_the_formulas_exactly(measured, i):
    """tp: every block's attention and MLP, an MoE layer's all-gather and reduce-scatter under SP
    (none without), the embedding, head and loss, the forward again with recompute and the
    sequence-parallel gradients' all-reduce (every expert's included); dp: ZeRO-3's rows once
    per step per group (dense over dp, experts over dp / ep), or 3 m times when resharding,
    ZeRO-0's all-reduces over dp and over dp / ep; the model states of ZeRO-3's rows."""
    config, experts = MEASURED[i]
    for pp_rank, held, sent, _, _ in (r[i] for r in measured):
        e = _estimate_of(i, pp_rank)
        if config.tp > 1:
            assert sum(v for (dim, _), v in sent.items() if dim == "tp") == e.bytes_per_step["tp"], config
        by_group = {"dp": 0.0, "dp / ep": 0.0}
        for what, nbytes, times, _ in e.dp_transfers:
            by_group["dp / ep" if what.endswith("dp / ep") else "dp"] += nbytes * times
        dp_sent = sent.get(("dp", "all_gather"), 0) + sent.get(("dp", "reduce_scatter"), 0)
        if config.zero_stage == 0:  # the gradients' all-reduce, and the loss's 4 bytes (dp = 2)
            dp_sent += sent[("dp", "all_reduce")] - 4
        assert dp_sent == by_group["dp"], config
        assert sum(v for (dim, _), v in sent.items() if dim == "edp") == by_group["dp / ep"], config
        assert held.params == e.model_states.params and held.grads == e.model_states.grads
        assert held.optimizer_state == e.model_states.optimizer_state, config


# est / measured peak per case: within (1, 1.10) where the formula bounds every term (what
# Korthikanti et al.'s fp32 terms count that this model does not store: dropout masks, attention
# scores), (1, 1.25) when resharding after forward (a unit's gradients and buffers counted beside
# a whole micro-batch's activations).
PEAK_RATIO = [(1, 1.10), (1, 1.10), (1, 1.10), (1, 1.10), (1, 1.25), (1, 1.25)]
# With experts the estimate assumes that every ep rank's experts receive as many rows as it
# dispatches (each expert its share), while routing decides: a received row stores its input,
# output, fc and GeLU outputs (fp32, 2 C + 2 d_ff numbers), and the backward as many gradients.
# The measured peak is corrected by each MoE forward's surplus of rows (measured, per rank), at
# one to two times a row's bytes, over the forwards whose activations can be alive at the peak
# (a micro-batch's blocks, recomputed or not): the ratio must lie in the bounds above for some
# correction in that interval.
ROW_BYTES = 4 * (2 * 32 + 2 * 128)  # CFG: C = 32, d_ff = 128


def _routing_correction(config, routed):
    """(least, most) bytes that routing added to a rank's measured peak, from each MoE forward's
    surplus rows in the step (`_measure_steps`), layers in order, micro-batch by micro-batch."""
    if not routed:
        return 0, 0
    # the forwards of one stage run: pp = 1 here, 1F1B holds one micro-batch's at a time; with
    # recompute each micro-batch runs twice (F without graph, then B's forward again, the whole
    # stage at once, `reference.pipeline_parallel.recompute`), routing the same rows both times
    per_run = len(routed) // (config.microbatches * (2 if config.activation_checkpointing else 1))
    alive = [routed[j:j + per_run] for j in range(0, len(routed), per_run)]
    sums = [sum(a) * ROW_BYTES * c for a in alive for c in (1, 2)]
    return min(sums + [0]), max(sums + [0])


@pytest.mark.parametrize("i", range(len(MEASURED)), ids=[str(c) for c, _ in MEASURED])
def test_the_step_peak_against_the_measured_one(measured, i):
    """The estimated peak of each rank's pipeline stage against the bytes of every tensor alive
    during its second step (with experts, corrected by what routing adds or takes: above)."""
    lower, upper = PEAK_RATIO[i]
    config = MEASURED[i][0]
    for pp_rank, _, _, peak, routed in (r[i] for r in measured):
        e = _estimate_of(i, pp_rank)
        est = e.total_bytes
        least, most = _routing_correction(config, routed)
        # With one micro-batch its backward is the step's only one: it starts with no gradient,
        # and the gradients the estimate counts whole beside the recomputed stage grow only as
        # that stage's activations go, so they over-count by up to their bytes (the MoE case
        # with recompute: its layers' bytes counted whole since `moe_activation_bytes` counts the
        # router's and the combine's, 1.14 of the peak, 1.04 less the gradients).
        over = e.model_states.grads if config.microbatches == 1 else 0
        # some corrected peak in [peak - most, peak - least] lies in [est / upper, est / lower]
        assert peak - most <= est / lower and (est - over) / upper <= peak - least, (
            MEASURED[i], pp_rank, est / peak, (least, most))


def test_traffic_counts_what_megatron_sends():
    """Three counts against Megatron-LM's code, each failing on the estimate before them. Its
    distributed optimizer in bf16 reduce-scatters fp32 gradients (4 bytes) and all-gathers bf16
    parameters (2 bytes). Under SP its column-parallel layers all-gather their input again in
    backward (`wgrad_compute`), what Korthikanti's sbh/t activations assume: one U more for
    c_attn, each dense c_fc and the head. A pipeline's first stage sends activations only, its
    last gradients only, a middle one both; interleaved, rank 0 holds chunks 0 and pp."""
    from reference.memory import Precision

    model = GPTConfig(vocab_size=50257, block_size=2048, n_layer=24, n_head=32, n_embd=2048)
    e = estimate(model, ParallelConfig(dp=4, zero_stage=1, precision="bf16"), micro_batch=1, global_batch=4,
                 precision=Precision(param=2, grad=4, optimizer=12))
    (_, scatter, _, _), (_, gather, _, _) = e.dp_transfers
    assert (scatter, gather) == (3 / 4 * 4 * e.params_per_gpu, 3 / 4 * 2 * e.params_per_gpu)
    sp = ParallelConfig(tp=4, sequence_parallel=True, precision="bf16")
    kept, regathered = (estimate(model, sp, micro_batch=1, global_batch=1, regather_input=r).bytes_per_step["tp"]
                        for r in (False, True))
    assert estimate(model, sp, micro_batch=1, global_batch=1).bytes_per_step["tp"] == regathered  # the default
    assert regathered - kept == (2 * 24 + 1) * 3 / 4 * 2048 * 2048 * 2
    S = 2048 * 2048 * 2
    for config, want in ((ParallelConfig(pp=4, microbatches=8, precision="bf16"), [1, 2, 2, 1]),
                         (ParallelConfig(pp=2, microbatches=8, precision="bf16"), [1, 1]),
                         (ParallelConfig(pp=4, virtual_stages=2, microbatches=8, precision="bf16"), [3, 4, 4, 3])):
        sends = [estimate(model, config, micro_batch=1, global_batch=8, stage=r).bytes_per_step["pp"] / (8 * S)
                 for r in range(config.pp)]
        assert sends == want, config
