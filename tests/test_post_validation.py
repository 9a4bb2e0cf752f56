"""Optimizer post-validation (`reference.parallel.post_validation`) in the real step.

Four steps of the tiny GPT, each configuration run twice on the same ranks, with the global checks
before the step (the synchronous step) and after it (``optimizer_post_validation``): step 0 passes
the checks, step 1's norm is above ``max_norm`` (the clip bites: rolled back, clipped, stepped
again), step 2 holds an inf in one rank's gradient (the fp16 overflow test fails: every stage
rolls back and the step is skipped), step 3 passes. The overflow is injected into one rank's
gradient and the run is fp32 under a static loss scale of 1, so that the scaler's test runs and one
process stays comparable. Both runs end with the same losses, norms and weights bit for bit
(`tolerance.exact`: the rollback restores an exact copy and the checks are the synchronous
step's own arithmetic), and the weights equal one process's (`adamw_weights`). Pipelines of 2
ranks (alone; with dp 2; with tp 2 and SP) and of 4, under ZB-H1, ZB-H2 and ZB-V: one launch of 2
ranks and one of 4. A third launch runs fp16 with the dynamic loss scaler, whose first step really
overflows (no injection), against the synchronous step and one process in fp16.
"""
import functools

import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.runtime import launch
from reference.tolerance import adamw_weights, exact, loss

CFG = GPTConfig.tiny(n_layer=8, block_size=16)
B, T, LR, EPS = 8, 16, 1e-3, 1e-6
NORMS = (1e3, 1e-2, 1e3, 1e3)  # max_norm per step: only step 1's is below the gradient's norm
OVERFLOW_STEP, OVERFLOW_RANK = 2, 1


def _batches():
    g = torch.Generator().manual_seed(99)
    data = torch.randint(0, 256, (len(NORMS), B, T + 1), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def _train(config):
    import torch.distributed as dist

    from reference.parallel import parallelize, train_step
    from reference.parallel.gather import full_state_dict
    from reference.parallel.scaler import DynamicLossScaler

    torch.manual_seed(0)
    pm = parallelize(GPT(CFG), config.mesh().build_groups(), config, batch=(B, T))
    opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    scaler = DynamicLossScaler(static=1.0)
    step = [0]
    plain = pm.data_parallel.local_grads

    def poisoned(pm_, opt_):  # one rank's gradient overflows at OVERFLOW_STEP
        grads = plain(pm_, opt_)
        if step[0] == OVERFLOW_STEP and dist.get_rank() == OVERFLOW_RANK:
            grads[0].view(-1)[0] = float("inf")
        return grads

    pm.data_parallel.local_grads = poisoned
    out = dict(losses=[], norms=[], skipped=[], labels=[])
    for step[0], ((idx, tgt), max_norm) in enumerate(zip(_batches(), NORMS)):
        r = train_step(pm, opt, idx, tgt, max_norm=max_norm, scaler=scaler)
        out["losses"].append(float(r.loss))
        out["norms"].append(None if r.grad_norm is None else r.grad_norm.clone())
        out["skipped"].append(r.skipped)
        out["labels"].append([e.label for e in r.trace if e.kind == "optimizer"])
    out["params"] = [p.detach().clone() for p in pm.parameters()]
    out["state"] = full_state_dict(pm)
    return out


def _body(configs):
    return [(_train(c), _train(c.with_(optimizer_post_validation=True))) for c in configs]


def _configs(world):
    from reference.parallel.config import ParallelConfig

    if world == 2:
        return [ParallelConfig(pp=2, microbatches=4, schedule="zb-h2")]
    return [ParallelConfig(pp=2, dp=2, microbatches=4, schedule="zb-h1"),
            ParallelConfig(pp=2, tp=2, sequence_parallel=True, microbatches=4, schedule="zb-h2"),
            ParallelConfig(pp=4, microbatches=8, schedule="zb-v", virtual_stages=2)]


@functools.lru_cache(maxsize=None)
def _one_process(chunks):
    from reference.train.single import accumulate_gradients, accumulated_step

    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for i, ((idx, tgt), max_norm) in enumerate(zip(_batches(), NORMS)):
        if i == OVERFLOW_STEP:  # skipped: the gradients computed, no step
            opt.zero_grad(set_to_none=True)
            losses.append(float(accumulate_gradients(model, idx, tgt, chunks)))
        else:
            losses.append(accumulated_step(model, opt, idx, tgt, chunks, max_norm=max_norm)[0])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world", [2, 4])
def test_post_validation_equals_the_synchronous_step_and_one_process(world):
    configs = _configs(world)
    ranks = launch(_body, world, configs, timeout=300)
    for i, config in enumerate(configs):
        for rank, runs in enumerate(ranks):
            sync, post = runs[i]
            where = f"{config} rank {rank}"
            assert post["skipped"] == sync["skipped"] == [False, False, True, False], where
            assert post["losses"] == sync["losses"], where
            for a, b in zip(post["norms"], sync["norms"]):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), where
            for a, b in zip(post["params"], sync["params"]):
                exact().assert_close(a, b, f"{where}: weights after the rollbacks")
            # what happened: stepped, rolled back and redone clipped, rolled back and skipped, stepped
            assert post["labels"] == [["step (eager)"], ["step (eager)", "rolled back, clipped, stepped"],
                                      ["step (eager)", "rolled back (overflow)"], ["step (eager)"]], where
            assert sync["labels"] == [["step"], ["step"], ["skipped"], ["step"]], where
        losses, state = _one_process(config.dp * config.microbatches)
        loss().assert_losses(ranks[0][i][1]["losses"], losses, str(config))
        got = ranks[0][i][1]["state"]
        want = {k: v for k, v in state.items() if k in got}
        assert set(want) >= {k for k in state if k != "lm_head.weight"}
        adamw_weights(len(NORMS) - 1, LR).assert_weights(got, want, f"{config} against one process")


def test_refused_with_zero():
    from reference.parallel.config import ParallelConfig

    config = ParallelConfig(dp=2, zero_stage=1, optimizer_post_validation=True)
    assert any("optimizer_post_validation" in p for p in config.problems(2, None, None, None))


# A real fp16 overflow, nothing injected: the dynamic loss scale starts at 2^20, where the scaled
# gradients of every block's MLP overflow fp16's 65504 on both pipeline ranks (the test checks each
# rank's own verdict), and halves to 2^19, where they do not. Step 0 is skipped, steps 1 and 2 run,
# step 2 clipped.
FP16_POWER, FP16_NORMS = 20, (1e3, 1e3, 1e-2)


def _train_fp16(config):
    from reference.comms import CommMeter
    from reference.parallel import parallelize, train_step
    from reference.parallel.gather import full_state_dict
    from reference.parallel.scaler import DynamicLossScaler

    torch.manual_seed(0)
    pm = parallelize(GPT(CFG), config.mesh().build_groups(), config, batch=(B, T))
    opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    scaler = DynamicLossScaler(initial_scale_power=FP16_POWER, hysteresis=1)
    started, local = scaler.start_check, []

    def recording(grads, group=None):  # this rank's own verdict, before the all-reduce
        local.append(any(not torch.isfinite(g).all() for g in grads))
        return started(grads, group)

    scaler.start_check = recording
    out = dict(losses=[], norms=[], skipped=[], scales=[], labels=[], local=local)
    meter = CommMeter()
    for (idx, tgt), max_norm in zip(_batches(), FP16_NORMS):
        with meter:
            r = train_step(pm, opt, idx, tgt, max_norm=max_norm, scaler=scaler)
        out["losses"].append(float(r.loss))
        out["norms"].append(None if r.grad_norm is None else r.grad_norm.clone())
        out["skipped"].append(r.skipped)
        out["scales"].append(r.loss_scale)
        out["labels"].append([e.label for e in r.trace if e.kind == "optimizer"])
    out["params"] = [p.detach().clone() for p in pm.parameters()]
    out["state"] = full_state_dict(pm)
    out["comms"] = meter.records()
    return out


def test_a_real_fp16_overflow_rolls_back_every_stage():
    """fp16 at pp 2 (ZB-H2) with the dynamic loss scaler: the post-validated run equals the
    synchronous one bit for bit (the same skips, scales, losses, norms and weights: every stage
    rolled its eager step back), meters the same collectives, and equals one process in fp16
    within the policy's tolerance."""
    from reference.parallel.config import ParallelConfig
    from reference.parallel.scaler import DynamicLossScaler
    from reference.train.single import accumulated_step

    config = ParallelConfig(pp=2, microbatches=4, schedule="zb-h2", precision="fp16")
    ranks = launch(_body_fp16, 2, config, timeout=300)
    scale = 2.0 ** FP16_POWER
    for rank, (sync, post) in enumerate(ranks):
        where = f"rank {rank}"
        assert post["local"] == sync["local"] == [True, False, False], where  # a real overflow here
        assert post["skipped"] == sync["skipped"] == [True, False, False], where
        assert post["scales"] == sync["scales"] == [scale, scale / 2, scale / 2], where
        assert post["losses"] == sync["losses"], where
        for a, b in zip(post["norms"], sync["norms"]):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), where
        for a, b in zip(post["params"], sync["params"]):
            exact().assert_close(a, b, f"{where}: weights after the rollback")
        assert post["labels"] == [["step (eager)", "rolled back (overflow)"], ["step (eager)"],
                                  ["step (eager)", "rolled back, clipped, stepped"]], where
        # every check metered (`DynamicLossScaler.start_check` through reference.comms): 3 flags of
        # 4 bytes and the norms of the steps that clip, 2 synchronously (the skipped step does
        # not) and 3 post-validated (the norm starts before the flag is known)
        for run, calls in ((sync, 5), (post, 6)):
            world = [r for r in run["comms"] if r["op"] == "all_reduce" and r["group"] == "world"]
            assert [(r["calls"], r["payload_bytes"]) for r in world] == [(calls, 4 * calls)], (where, world)
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    scaler = DynamicLossScaler(initial_scale_power=FP16_POWER, hysteresis=1)
    losses, skipped = [], []
    for (idx, tgt), max_norm in zip(_batches(), FP16_NORMS):
        value, skip = accumulated_step(model, opt, idx, tgt, config.microbatches, precision="fp16",
                                       scaler=scaler, max_norm=max_norm)
        losses.append(value), skipped.append(skip)
    assert skipped == [True, False, False] and scaler.scale == scale / 2
    loss(torch.float16).assert_losses(ranks[0][1]["losses"], losses, "fp16 against one process")
    got = ranks[0][1]["state"]
    want = {k: v.detach() for k, v in model.state_dict().items() if k in got}
    adamw_weights(2, LR, dtype=torch.float16).assert_weights(got, want, "fp16 against one process")


def _body_fp16(config):
    return _train_fp16(config), _train_fp16(config.with_(optimizer_post_validation=True))
