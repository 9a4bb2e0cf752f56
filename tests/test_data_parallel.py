"""reference.data_parallel: naive DP and bucketed DDP equal single-process training on the
full batch and PyTorch's own DistributedDataParallel; no_sync, tied, frozen and unused
parameters; bytes and calls counted with the meter; the overlap trace; the device rule.

Every rank trains on its slice of one global batch. The loss is a mean over equal
slices, so the mean of the ranks' gradients is the full-batch gradient and the
parameters after each AdamW step must equal those of one process on the whole batch.
All distributed checks run in one `launch` per world size (the `dp_run` fixture);
the tests below read its results. Models and batches go to `reference.runtime.device()`
(the CPU under gloo), so tests/test_gpu.py runs the same bodies and checks on NCCL.
"""
import time
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comms
from reference.data import synthetic_batch
from reference.data_parallel import DDP, format_buckets, naive_all_reduce_gradients, plan_buckets
from reference.data_parallel.device import StepClock, backend_device
from reference.model import GPT, GPTConfig
from reference.runtime import device, launch
from reference.tolerance import adamw_weights, exact, gradient
from reference.train import make_optimizer
from reference.train.single import accumulated_step

CFG = GPTConfig.tiny()  # 2 layers, C = 32, vocab 256: every parameter's numel divides by 4
BATCH, SEQ, STEPS, LR = 8, 16, 3, 1e-3
# Caps in MiB: one bucket for the whole tiny GPT (~140 KB), and 4 KiB, which gives 19.
ONE_BUCKET, MANY_BUCKETS = 25, 4096 / 2**20
N_MANY = len(plan_buckets(GPT.from_config_seed(CFG, 0).named_parameters(), 4096))
TIMEOUT = 90.0
# Tolerances: the course's policy (reference.tolerance says why). The ranks' sum of slice
# gradients and one process's full-batch sum add the same terms in another order:
# `gradient(N)` for N ranks. Parameters after AdamW steps: `adamw_weights(steps, LR)`, every
# weight, the mean over all of them and each tensor's mean. AdamW is blind to a gradient's
# scale (a sum mistaken for a mean would pass the parameters), so the tests compare the
# gradients of every step too. AdamW's eps is 1e-6 rather than PyTorch's 1e-8: fewer
# gradients near eps, whose last-bit differences AdamW turns into steps (notebook 01's side
# note).
ADAM_EPS = 1e-6


def _is_exact(tol):
    return tol["rtol"] == 0 and tol["atol"] == 0


# ----------------------------------------------------------------------------- helpers
def _global_batch(step):
    return synthetic_batch(BATCH, SEQ, vocab_size=CFG.vocab_size, seed=0, step=step)


def _gpt(cfg=CFG, seed=0):
    """The tiny GPT on this rank's device (the CPU under gloo, its GPU under NCCL)."""
    return GPT.from_config_seed(cfg, seed).to(device())


def _my_slice(t):
    """This rank's contiguous B / N rows of the global batch."""
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def _optimizer(model):
    return make_optimizer(model, LR, eps=ADAM_EPS)


def _params(module):
    return {n: p.detach().cpu().clone() for n, p in module.named_parameters()}


def _grads(module):
    return {n: p.grad.cpu().clone() for n, p in module.named_parameters() if p.grad is not None}


def _single_process(cfg=CFG, steps=STEPS, freeze=(), batch=_global_batch):
    """The oracle (`accumulated_step`): one process, the whole batch ``batch(step)``, the same
    AdamW. Returns (params, grads per step)."""
    model = GPT.from_config_seed(cfg, 0)
    for n, p in model.named_parameters():
        p.requires_grad_(n not in freeze)
    opt = _optimizer(model)
    grads = []
    for step in range(steps):
        accumulated_step(model, opt, *batch(step))
        grads.append(_grads(model))  # the step's gradients stay in .grad after the step
    return _params(model), grads


def _train(model, opt, steps=STEPS, after_backward=None):
    """Train on this rank's slices; returns (params, synchronised grads per step)."""
    inner = getattr(model, "module", model)  # names without DDP's "module." prefix
    dev = next(inner.parameters()).device
    grads = []
    for step in range(steps):
        x, y = (t.to(dev) for t in _global_batch(step))
        model(_my_slice(x), _my_slice(y))[1].backward()
        if after_backward is not None:
            after_backward(step)
        grads.append(_grads(inner))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _params(inner), grads


def _assert_equal(got, want, what, tol):
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{what}, {name}: {m}")


def _assert_run_equal(got, want, what, tol):
    """(params, grads per step) against the oracle's: the gradients to ``tol``, the parameters
    to `adamw_weights` after those steps (every one, their mean and each tensor's), or to ``tol`` when the
    run is exact."""
    for step, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
        _assert_equal(g, w, f"{what}, gradient of step {step}", tol)
    steps = len(want[1])
    assert got[0].keys() == want[0].keys(), what
    weights = exact() if _is_exact(tol) else adamw_weights(steps, LR)
    weights.assert_weights(got[0], want[0], f"{what}, parameters after {steps} steps")


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------- one launch per world size
def _all_checks():
    """Every distributed body below, on one set of ranks: a launch costs far more
    (new processes importing torch) than these tiny models' training."""
    bodies = dict(parity=_parity_body, torch=_against_torch_body, no_sync=_no_sync_body,
                  tied_frozen=_tied_frozen_body, unused=_unused_body, overlap=_overlap_body,
                  cap0=_bucket_cap_zero_body, device=_device_body)
    return {name: body() for name, body in bodies.items()}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"dp{n}")
def dp_run(request):
    """(world size, per-rank results of `_all_checks`)."""
    return request.param, launch(_all_checks, request.param, backend="gloo", timeout=TIMEOUT)


# ------------------------------------------------------------------- without processes
def test_bucket_layout_reverse_order_cap_tied_and_frozen():
    model = GPT.from_config_seed(CFG, 0)
    model.wpe.weight.requires_grad_(False)
    cap = 4096
    buckets = plan_buckets(model.named_parameters(), cap)
    names = [n for b in buckets for n in b.names]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    # Last registered parameter first (backward's order); the tied lm_head.weight is
    # wte.weight, listed once; the frozen wpe has no bucket.
    assert names == trainable[::-1]
    assert "lm_head.weight" not in names and names.count("wte.weight") == 1
    assert "wpe.weight" not in names
    for b in buckets:
        # At most the cap, unless one parameter alone is larger (then it is alone).
        assert b.nbytes <= cap or len(b.names) == 1, b
        assert b.offsets == [sum(b.numels[:k]) for k in range(len(b.numels))]
    oversized = [b for b in buckets if b.nbytes > cap]
    assert oversized and all(len(b.names) == 1 for b in oversized)
    # Every bucket was closed because the next parameter would not fit.
    for b, nxt in zip(buckets, buckets[1:]):
        assert b.nbytes + nxt.numels[0] * 4 > cap
    assert len(plan_buckets(model.named_parameters(), 2**30)) == 1
    # A small first bucket (PyTorch's 1 MiB, here 1 KiB) starts communication early.
    small_first = plan_buckets(model.named_parameters(), 2**30, first_cap_bytes=1024)
    assert len(small_first) == 2 and small_first[0].nbytes <= 1024
    assert small_first[0].names + small_first[1].names == names
    assert "bucket 0:" in format_buckets(buckets)


def test_bad_arguments_are_named():
    model = GPT.from_config_seed(CFG, 0)
    # 0 is a valid cap (one bucket per parameter, as in PyTorch); a negative one is not.
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be a number of MiB >= 0 .* got -1"):
        DDP(model, bucket_cap_mb=-1)
    with pytest.raises(ValueError, match="first_bucket_cap_mb"):
        DDP(model, first_bucket_cap_mb=-1)
    with pytest.raises(ValueError, match="cap_bytes"):
        plan_buckets(model.named_parameters(), -1)
    with pytest.raises(RuntimeError, match="launch"):
        DDP(model)  # no process group in this process
    with pytest.raises(RuntimeError, match="launch"):
        DDP(model, bucket_cap_mb=0)  # accepted: it gets as far as the missing process group


def test_cap_zero_plans_one_bucket_per_parameter():
    model = GPT.from_config_seed(CFG, 0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    for first in (None, 0):  # DDP passes min(cap, first cap): 0 here too
        buckets = plan_buckets(model.named_parameters(), 0, first_cap_bytes=first)
        assert [b.names for b in buckets] == [[n] for n in trainable[::-1]]


# -------------------------------------------------------------------- parity and bytes
def _parity_body():
    out = {}
    # Naive DP: every rank starts from the same seed (nothing is broadcast).
    model = _gpt()
    with comms.meter() as m:
        out["naive"] = _train(model, _optimizer(model), after_backward=lambda step: naive_all_reduce_gradients(model))
    out["naive stats"] = dict(calls=m.calls("all_reduce"), sent=m.sent_bytes("all_reduce"),
                              n_params=len(list(model.parameters())))

    for label, cap in (("one bucket", ONE_BUCKET), ("many buckets", MANY_BUCKETS)):
        # A different seed on every rank: equality with the oracle (seed 0) also
        # proves that wrapping broadcast rank 0's weights.
        ddp = DDP(_gpt(seed=dist.get_rank()), bucket_cap_mb=cap)
        opt = _optimizer(ddp)  # ddp.parameters() are the module's own
        per_step, grads = [], []

        def measure(step):
            # The meter is cumulative: differences of these give one step's counts.
            per_step.append((m.calls("all_reduce"), m.payload_bytes("all_reduce"), m.sent_bytes("all_reduce")))
            grads[:] = [p.grad for p in ddp.parameters() if p.grad is not None]

        with comms.meter() as m:
            out[label] = _train(ddp, opt, after_backward=measure)
        opt_state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]  # not the 0-dim step
        out[label + " stats"] = dict(
            n_buckets=len(ddp.buckets),
            per_step=[tuple(b - a for a, b in zip(prev, cur)) for prev, cur in zip([(0, 0, 0)] + per_step, per_step)],
            param_bytes=_bytes(ddp.parameters()), grad_bytes=_bytes(grads),
            optimizer_bytes=_bytes(opt_state), bucket_bytes=ddp.bucket_nbytes,
            same_parameters=[id(p) for p in ddp.parameters()] == [id(p) for p in ddp.module.parameters()],
        )
    return out


def test_naive_and_ddp_equal_single_process_and_send_the_ring_volume(dp_run):
    check_parity(*dp_run)


def check_parity(world_size, results, tol=None):
    tol = gradient(world_size) if tol is None else tol  # summed over the ranks
    oracle = _single_process()
    psi = sum(p.numel() for p in GPT.from_config_seed(CFG, 0).parameters())
    ring = Fraction(2 * (world_size - 1), world_size) * 4 * psi  # fp32 gradient: 4 psi bytes
    for rank, out in enumerate(r["parity"] for r in results):
        for variant in ("naive", "one bucket", "many buckets"):
            _assert_run_equal(out[variant], oracle, f"dp={world_size} rank {rank} {variant}", tol)
        # Naive DP: one all-reduce per parameter, the same bytes as DDP in total.
        naive = out["naive stats"]
        assert naive["calls"] == naive["n_params"] * STEPS and naive["sent"] == ring * STEPS
        for variant, n_buckets in (("one bucket", 1), ("many buckets", N_MANY)):
            s = out[variant + " stats"]
            assert s["n_buckets"] == n_buckets and s["same_parameters"]
            # One all-reduce per bucket per step, each gradient in exactly one of
            # them, so a rank sends 2(N-1)/N of the gradient bytes per step (exact:
            # every bucket's numel divides by N here).
            assert s["per_step"] == [(n_buckets, 4 * psi, ring)] * STEPS
            # Memory per rank, fp32 AdamW: 4 psi weights, 4 psi gradients, 8 psi
            # optimizer state (exp_avg, exp_avg_sq), whatever the dp size: DDP
            # replicates everything (the ZeRO paper's baseline). The buckets add
            # 4 psi of communication buffers.
            assert s["param_bytes"] == 4 * psi and s["grad_bytes"] == 4 * psi
            assert s["optimizer_bytes"] == 8 * psi
            assert s["bucket_bytes"] == 4 * psi


# --------------------------------------------------------------- PyTorch's own DDP
def _against_torch_body():
    ours = DDP(_gpt(), bucket_cap_mb=MANY_BUCKETS)
    theirs = nn.parallel.DistributedDataParallel(_gpt())
    return _train(ours, _optimizer(ours)), _train(theirs, _optimizer(theirs))


def test_ddp_equals_pytorch_distributed_data_parallel(dp_run):
    check_against_torch(*dp_run)


def check_against_torch(world_size, results, tol=None):
    tol = gradient(world_size) if tol is None else tol  # summed over the ranks
    for rank, (ours, theirs) in enumerate(r["torch"] for r in results):
        _assert_run_equal(ours, theirs, f"dp={world_size} rank {rank}", tol)


# ------------------------------------------------------------- gradient accumulation
ACCUM = 2


def _no_sync_body():
    ddp = DDP(_gpt(), bucket_cap_mb=MANY_BUCKETS)
    opt = _optimizer(ddp)
    inside, synced = [], []
    for step in range(STEPS):
        # This step's global batch is ACCUM * BATCH rows; this rank takes its slice
        # and runs it as ACCUM micro-batches, each loss scaled by 1 / ACCUM.
        x, y = (t.to(device()) for t in synthetic_batch(ACCUM * BATCH, SEQ, seed=1, step=step))
        micro = list(zip(_my_slice(x).chunk(ACCUM), _my_slice(y).chunk(ACCUM)))
        with comms.meter() as m:
            with ddp.no_sync():
                for mx, my in micro[:-1]:
                    (ddp(mx, my)[1] / ACCUM).backward()
                ddp.finish_gradient_synchronization()  # nothing launched: a no-op
            inside.append(m.calls())
            local = ddp.module.h[0].attn.c_attn.weight.grad.cpu().clone()
            (ddp(*micro[-1])[1] / ACCUM).backward()
            ddp.finish_gradient_synchronization()  # backward already waited: a no-op
            synced.append(m.calls())
        opt.step()
        opt.zero_grad(set_to_none=True)
    # `local`, the last unsynchronised gradient, shows that no_sync kept it local.
    return _params(ddp.module), inside, synced, len(ddp.buckets), local


def test_no_sync_accumulation_equals_one_big_batch(dp_run):
    check_no_sync(*dp_run)


def check_no_sync(world_size, results, tol=None):
    tol = gradient(world_size) if tol is None else tol  # summed over the ranks
    results = [r["no_sync"] for r in results]
    oracle, _ = _single_process(batch=lambda step: synthetic_batch(ACCUM * BATCH, SEQ, seed=1, step=step))
    for rank, (params, inside, synced, n_buckets, local) in enumerate(results):
        # Only the parameters: their mean difference is what a wrong accumulation would move.
        weights = exact() if _is_exact(tol) else adamw_weights(STEPS, LR)
        weights.assert_weights(params, oracle, f"dp={world_size} rank {rank}")
        assert inside == [0] * STEPS  # no communication inside no_sync
        assert synced == [n_buckets] * STEPS  # the accumulated sum is all-reduced once
    assert not torch.equal(results[0][4], results[1][4])


# ------------------------------------------------------- tied, frozen, buffers
FROZEN = ("wpe.weight", "h.0.ln_1.weight", "h.0.ln_1.bias")


def _tied_frozen_body():
    r = dist.get_rank()
    out = {}
    for tied in (True, False):
        model = _gpt(GPTConfig.tiny(tie_weights=tied), r)  # differs per rank until wrapped
        for n, p in model.named_parameters():
            p.requires_grad_(n not in FROZEN)
        model.register_buffer("running", torch.full((5,), float(r), device=device()))  # a buffer to broadcast
        frozen_before = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if n in FROZEN}
        ddp = DDP(model, bucket_cap_mb=MANY_BUCKETS)
        frozen_after_wrap = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if n in FROZEN}
        with comms.meter() as m:
            run = _train(ddp, _optimizer(ddp))
        out[tied] = dict(
            run=run, names=[name for b in ddp.buckets for name in b.names],
            frozen_before=frozen_before, frozen_after_wrap=frozen_after_wrap,
            frozen_grads=[p.grad for n, p in model.named_parameters() if n in FROZEN],
            buffer=model.running.cpu().clone(), payload_per_step=m.payload_bytes("all_reduce") / STEPS,
            trainable_bytes=_bytes(p for p in ddp.parameters() if p.requires_grad),
            still_tied=model.lm_head.weight is model.wte.weight,
        )
    return out


def test_tied_weights_frozen_parameters_and_buffers(dp_run):
    check_tied_frozen(*dp_run)


def check_tied_frozen(world_size, results, tol=None):
    tol = gradient(world_size) if tol is None else tol  # summed over the ranks
    results = [r["tied_frozen"] for r in results]
    for tied in (True, False):
        cfg = GPTConfig.tiny(tie_weights=tied)
        oracle = _single_process(cfg, freeze=FROZEN)
        seed0 = dict(GPT.from_config_seed(cfg, 0).named_parameters())
        for rank, out in enumerate(results):
            o = out[tied]
            _assert_run_equal(o["run"], oracle, f"rank {rank} tied={tied}", tol)
            # Frozen parameters: broadcast from rank 0 at wrap, then never in a bucket,
            # never communicated (a step's payload is the trainable gradients only),
            # never given a gradient, never changed.
            assert not set(FROZEN) & set(o["names"])
            assert o["frozen_grads"] == [None] * len(FROZEN)
            assert o["payload_per_step"] == o["trainable_bytes"]
            for name in FROZEN:
                exact().assert_close(o["frozen_after_wrap"][name], seed0[name].detach(), f"{name} after wrap")
                exact().assert_close(o["run"][0][name], seed0[name].detach(), f"{name} after the run")
            if rank > 0:  # LayerNorms start at 1 and 0 on every seed; wpe is random
                assert not torch.equal(o["frozen_before"]["wpe.weight"], seed0["wpe.weight"].detach())
            exact().assert_close(o["buffer"], torch.zeros(5), "the buffer")  # rank 0's, broadcast
            # A tied weight is one parameter: one bucket slot (its hook fires once,
            # after both uses are summed), and it stays tied.
            assert o["names"].count("wte.weight") == 1
            assert ("lm_head.weight" in o["names"]) == (not tied)
            assert o["still_tied"] == tied


# --------------------------------------------------------------- unused parameters
class _TwoHeads(nn.Module):
    """Rows flagged in `route` go to head_b, the others to head_a; `spare` is never used.

    A head that gets no rows is not called at all, so its parameters get no
    gradient on that rank: data-dependent routing, as in a mixture of experts.
    """

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head_a = nn.Linear(8, 1)
        self.head_b = nn.Linear(8, 1)
        self.spare = nn.Linear(8, 1)

    def forward(self, x, target, route):
        h = torch.tanh(self.body(x))  # (B, 8)
        sq = x.new_zeros(())
        for head, rows in ((self.head_a, ~route), (self.head_b, route)):
            if rows.any():
                sq = sq + ((head(h[rows]) - target[rows]) ** 2).sum()
        return sq / x.shape[0]  # mean squared error over this rank's rows


# Rows of the 8-row global batch routed to head_b at each step: in step 0 only the
# first rank's slice uses head_b, in step 1 no rank does (after step 0 gave it
# AdamW state), in step 2 the first and the last rank do.
ROUTES = ([0], [], [0, 7])


def _two_heads_batch(step):
    g = torch.Generator().manual_seed(step)
    x, target = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)
    route = torch.zeros(BATCH, dtype=torch.bool)
    route[ROUTES[step]] = True
    return x, target, route


def _two_heads_oracle():
    """(final params, grads per step, params after each step) of one process (`accumulated_step`
    with the toy model's own loss)."""
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = _optimizer(model)
    grads, params = [], []
    for step in range(len(ROUTES)):
        x, target, route = _two_heads_batch(step)
        accumulated_step(model, opt, x, target, loss_fn=lambda m, x, y, route=route: (m(x, y, route), 0.0))
        grads.append(_grads(model))  # the step's gradients stay in .grad after the step
        params.append(_params(model))
    return params[-1], grads, params


def _unused_body():
    out = {}
    for find_unused in (False, True):
        for cap in (ONE_BUCKET, 1e-9):  # one bucket; one bucket per parameter
            torch.manual_seed(0)
            ddp = DDP(_TwoHeads().to(device()), bucket_cap_mb=cap, find_unused_parameters=find_unused)
            opt = _optimizer(ddp)
            grads, params, calls, launched_late = [], [], [], []
            for step in range(len(ROUTES)):
                with comms.meter() as m:
                    ddp(*(_my_slice(t).to(device()) for t in _two_heads_batch(step))).backward()
                calls.append(m.calls("all_reduce"))
                grads.append(_grads(ddp.module))
                end = next(e["time"] for e in ddp.trace if e["event"] == "backward_end")
                launched_late.append(sorted(e["bucket"] for e in ddp.trace if e["event"] == "launch" and e["time"] > end))
                opt.step()
                opt.zero_grad(set_to_none=True)
                params.append(_params(ddp.module))
            out[find_unused, cap] = dict(params=params, grads=grads, calls=calls,
                                         n_buckets=len(ddp.buckets), launched_late=launched_late)
    return out


def test_unused_parameters_complete_their_buckets(dp_run):
    check_unused(*dp_run)


def check_unused(world_size, results, tol=None, timing=True):
    tol = gradient(world_size) if tol is None else tol  # summed over the ranks
    oracle = _two_heads_oracle()
    for rank, out in enumerate(r["unused"] for r in results):
        for cap, n_buckets in ((ONE_BUCKET, 1), (1e-9, 8)):
            what = f"dp={world_size} rank {rank} cap={cap}"
            # find_unused_parameters=True: p.grad stays None exactly where no rank
            # produced a gradient, so the run equals the single process, AdamW's
            # skipping of gradient-less parameters included.
            found = out[True, cap]
            _assert_run_equal((found["params"][-1], found["grads"]), oracle[:2], what + " find_unused", tol)
            assert found["calls"] == [n_buckets + 1] * len(ROUTES)  # + the count of users
            # Default: a parameter unused on this rank contributes zeros and every
            # rank holds the mean, so the gradients equal the oracle's where it has
            # one and are zero where it has none (spare always, head_b in step 1).
            default = out[False, cap]
            assert default["calls"] == [n_buckets] * len(ROUTES)
            for step in (0, 1):  # up to where the runs part (below)
                got, want = default["grads"][step], oracle[1][step]
                assert got.keys() == {n for n, _ in _TwoHeads().named_parameters()}
                for name, g in got.items():
                    expected = want.get(name, torch.zeros_like(g))
                    torch.testing.assert_close(g, expected, **tol, msg=lambda m: f"{what} step {step} {name}: {m}")
            # AdamW's step 1 moves head_b with a zero gradient (its momentum from
            # step 0), which a single process, whose head_b.grad is None, skips.
            # spare, whose moments are still zero, does not move; the rest match.
            after_1, want_1 = default["params"][1], oracle[2][1]
            weights = exact() if _is_exact(tol) else adamw_weights(2, LR)
            weights.assert_weights({n: t for n, t in after_1.items() if not n.startswith("head_b")},
                                   {n: t for n, t in want_1.items() if not n.startswith("head_b")}, what)
            moved = (after_1["head_b.weight"] - want_1["head_b.weight"]).abs().mean().item()
            assert moved > adamw_weights(2, LR).mean_atol, moved  # beyond what rounding moves
            # The bucket of a parameter unused on this rank is launched only when
            # backward has ended, and so is every bucket after it (launch order is
            # bucket order). Per-parameter buckets: spare.bias, spare.weight come first.
            if cap != ONE_BUCKET and timing:
                assert default["launched_late"] == [list(range(n_buckets))] * len(ROUTES)


# ----------------------------------------------------------------------------- overlap
def _overlap_body():
    ddp = DDP(_gpt(), bucket_cap_mb=MANY_BUCKETS)
    start = time.perf_counter()
    traced = _train(ddp, _optimizer(ddp), steps=2)
    end = time.perf_counter()
    quiet = DDP(_gpt(), bucket_cap_mb=MANY_BUCKETS, trace=False)
    untraced = _train(quiet, _optimizer(quiet), steps=2)
    return dict(trace=ddp.trace, n_buckets=len(ddp.buckets), window=(start, end),
                on_gpu=ddp._clock.on_gpu, traced=traced, untraced=untraced, quiet_trace=quiet.trace)


def test_bucket_all_reduces_start_before_backward_ends(dp_run):
    check_overlap(*dp_run)


def check_overlap(world_size, results, tol=None):  # tol: the other checks' signature
    for out in (r["overlap"] for r in results):
        trace, n_buckets = out["trace"], out["n_buckets"]
        at = {}
        for e in trace:
            at.setdefault(e["event"], {})[e["bucket"]] = e["time"]
        # The trace is the last step's: one forward, one backward, every bucket once.
        assert [e["event"] for e in trace].count("forward_end") == 1
        assert sorted(at["launch"]) == sorted(at["wait_end"]) == list(range(n_buckets))
        launches = [at["launch"][i] for i in range(n_buckets)]
        backward_end = at["backward_end"][None]
        assert at["forward_end"][None] < launches[0]
        # Bucket 0's all-reduce (the last layers) started while backward was still
        # computing the gradients of the earlier layers, and the buckets went out
        # in order, all of them from inside backward. (On a GPU the last launch and
        # the end of backward can be two events with nothing between them: equal.)
        assert launches == sorted(launches)
        assert launches[-1] <= backward_end if out["on_gpu"] else launches[-1] < backward_end
        assert launches[0] < launches[-1]
        # Waiting starts only once backward is over, and never before a launch.
        for i in range(n_buckets):
            assert backward_end <= at["wait_start"][i] <= at["wait_end"][i]
        # Every moment is a perf_counter reading inside the training call (on a GPU:
        # an event converted to one), and trace=False records nothing and changes nothing.
        start, end = out["window"]
        assert all(type(e["time"]) is float and start <= e["time"] <= end for e in trace)
        assert out["quiet_trace"] == []
        # Tracing only reads clocks: the same arithmetic in the same order, bit for bit.
        _assert_run_equal(out["untraced"], out["traced"], "trace=False against trace=True", exact())


def test_cpu_clock_reads_perf_counter_and_touches_no_gpu(dp_run):
    """On the CPU the clock is time.perf_counter itself, as before GPU timing existed."""
    assert not any(r["overlap"]["on_gpu"] for r in dp_run[1])
    clock = StepClock(torch.device("cpu"))
    assert clock.event is None
    before = time.perf_counter()
    now = clock.now()
    assert type(now) is float and before <= now <= time.perf_counter()
    trace = [{"event": "launch", "bucket": 0, "time": now}]
    clock.resolve(trace)
    assert trace[0]["time"] == now  # nothing to convert


class _FakeEvent:
    """A stand-in for torch.cuda.Event: `record` notes the host time plus a fixed GPU lag."""

    LAG = 0.25  # seconds the "GPU" runs behind the host

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = time.perf_counter() + self.LAG

    def synchronize(self):
        while time.perf_counter() < self.at:  # the host waits until the GPU got there
            pass

    def elapsed_time(self, other):
        return (other.at - self.at) * 1e3  # ms, as CUDA reports it


def test_gpu_clock_turns_events_into_perf_counter_seconds():
    """The CUDA path's arithmetic, with a fake event: each moment is when the "GPU"
    reached it (host time + lag), not when the host recorded it."""
    clock = StepClock(torch.device("cuda", 0), event=_FakeEvent)
    recorded_at = time.perf_counter()
    first = clock.now()
    trace = [{"event": "launch", "bucket": 0, "time": first},
             {"event": "wait_end", "bucket": 0, "time": clock.now()}]
    clock.resolve(trace)
    times = [e["time"] for e in trace]
    assert all(type(t) is float for t in times) and times == sorted(times)
    # Converted through the synchronised last event: exact up to the host's reading of
    # perf_counter after the wait (a few microseconds; 20 ms leaves room for a busy machine).
    assert abs(times[0] - first.at) < 0.02
    assert times[0] >= recorded_at + _FakeEvent.LAG - 0.02


# ------------------------------------------------------- bucket_cap_mb=0, as PyTorch
def _bucket_cap_zero_body():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ours = DDP(_gpt(), bucket_cap_mb=0)
    theirs = nn.parallel.DistributedDataParallel(_gpt(), bucket_cap_mb=0)
    torch_buckets = [0]  # all-reduces PyTorch's DDP issues in each step, one per bucket

    def count(state, bucket):  # PyTorch's default hook (divide, then all-reduce), counted
        torch_buckets[-1] += 1
        return default_hooks.allreduce_hook(state, bucket)

    theirs.register_comm_hook(None, count)
    our_calls = []
    with comms.meter() as m:
        run = _train(ours, _optimizer(ours),
                     after_backward=lambda step: our_calls.append(m.calls("all_reduce")))
    torch_run = _train(theirs, _optimizer(theirs),
                       after_backward=lambda step: torch_buckets.append(0))
    # Caps given one per bucket (bucket_cap_mb_list, PyTorch 2.13) apply from the first iteration:
    # a 0 MiB cap makes a bucket per parameter at construction, where bucket_cap_mb=0 makes one.
    first = [len(nn.parallel.DistributedDataParallel(_gpt(), **cap).reducer._get_zeros_like_grad_buckets())
             for cap in (dict(bucket_cap_mb=0), dict(bucket_cap_mb_list=[0]))]
    return dict(ours=run, theirs=torch_run, our_calls=our_calls, torch_buckets=torch_buckets[:STEPS],
                first_buckets=first, names=[b.names for b in ours.buckets],
                trainable=[n for n, p in ours.module.named_parameters() if p.requires_grad])


def test_bucket_cap_zero_gives_each_parameter_its_own_all_reduce(dp_run):
    check_bucket_cap_zero(*dp_run)


def check_bucket_cap_zero(world_size, results, tol=None):
    tol = gradient(world_size) if tol is None else tol  # summed over the ranks
    for rank, out in enumerate(r["cap0"] for r in results):
        n = len(out["trainable"])  # 28 tensors in the tiny GPT, the tied weight once
        assert out["names"] == [[name] for name in out["trainable"][::-1]]
        # The meter is cumulative: one all-reduce per trainable parameter, every step.
        assert out["our_calls"] == [n * (step + 1) for step in range(STEPS)]
        # PyTorch's first backward runs on one bucket, then it rebuilds its buckets
        # in the order gradients arrived: one per parameter from the second step on.
        assert out["torch_buckets"][1:] == [n] * (STEPS - 1)
        # (notebook 01, ptddp01) with bucket_cap_mb_list the first iteration is bucketed already
        assert out["first_buckets"] == [1, n]
        _assert_run_equal(out["ours"], out["theirs"], f"dp={world_size} rank {rank} cap 0", tol)


# ----------------------------------------------------------------- device placement
def _device_body():
    try:
        DDP(nn.Linear(4, 4, device="meta"))  # "meta" stands for any device but the backend's
        message = None
    except ValueError as err:
        message = str(err)
    return dict(message=message, backend_device=str(backend_device()), device=str(device()))


def test_module_must_sit_on_the_backends_device(dp_run):
    check_device(*dp_run)


def check_device(world_size, results, tol=None):  # tol: the other checks' signature
    for out in (r["device"] for r in results):
        assert out["backend_device"] == out["device"]  # gloo: cpu; NCCL: this rank's GPU
        assert out["message"] is not None, "DDP wrapped a module that is not on the backend's device"
        assert f"communicates tensors on {out['device']}, but 'weight' is on meta" in out["message"]
        assert "(and 1 more tensor)" in out["message"]  # the bias
        assert "model.to(reference.runtime.device())" in out["message"]
