"""The optimizers of reference.zero work with torch's LR schedulers and state_dict.

`ZeroOptimizer` (stages 1 and 2) is a `torch.optim.Optimizer` whose `param_groups` are
its inner optimizer's, so a scheduler's `lr` (and OneCycleLR's `betas`) reach the
inner step; FSDP (stage 3) trains with a plain torch optimizer over its shards. For
each: the same scheduler gives the parameters one process gets, and a state saved
after 2 steps and loaded into a fresh wrapper continues exactly as the uninterrupted
run.
"""
import io

import pytest
import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR, StepLR

from reference.data import synthetic_batch
from reference.model import GPT, GPTConfig
from reference.runtime import launch
from reference.tolerance import adamw_weights
from reference.train.single import accumulated_step
from reference.zero import FSDP, ZeroOptimizer

CONFIG = GPTConfig.tiny()
BATCH, STEPS, LR = 8, 4, 1e-3
# Parameters after STEPS AdamW steps, the ranks' gradients summed in another order than one
# process's: the course's policy, `adamw_weights` (reference.tolerance), at the largest lr the
# schedule reached (OneCycleLR's peak, 2e-3): every weight, the mean over all of them and each
# tensor's mean.
TIMEOUT = 180.0
SCHEDULERS = {
    "step": lambda opt: StepLR(opt, step_size=1, gamma=0.5),
    "lambda": lambda opt: LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "onecycle": lambda opt: OneCycleLR(opt, max_lr=2e-3, total_steps=STEPS),  # cycles AdamW's betas too
}
WRAPPERS = ["zero1", "zero2", "fsdp"]


def _batch(step, rank=0, world=1):
    x, y = synthetic_batch(BATCH, CONFIG.block_size, seed=11, step=step)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return x[rows], y[rows]


def _wrap(kind, model):
    """(runner, optimizer) for a wrapper kind."""
    if kind == "fsdp":
        fsdp = FSDP(model)
        return fsdp, torch.optim.AdamW(fsdp.parameters(), lr=LR)
    # small buckets for stage 2: several reduce-scatters in each backward
    return model, ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=int(kind[-1]), lr=LR,
                                bucket_cap_mb=4096 * 4 / 2**20)


def _params(runner, model):
    if isinstance(runner, FSDP):
        return runner.full_state_dict()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _train(runner, opt, sched, steps, rank, world):
    """The wrapped run on this rank's rows of each step's batch."""
    def one_step(step):
        _, loss = runner(*_batch(step, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()

    return _scheduled(one_step, opt, sched, steps)


def _scheduled(one_step, opt, sched, steps):
    """``one_step(step)`` then the scheduler's step, for each step; what each step left set."""
    seen = []
    for step in steps:
        one_step(step)
        sched.step()
        inner = opt.optimizer if isinstance(opt, ZeroOptimizer) else opt
        # what the inner step will use next, beside what the scheduler says it set
        seen.append((inner.param_groups[0]["lr"], sched.get_last_lr()[0], inner.param_groups[0]["betas"]))
    return seen


def _one_process(sched_name):
    model = GPT.from_config_seed(CONFIG, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = SCHEDULERS[sched_name](opt)
    seen = _scheduled(lambda step: accumulated_step(model, opt, *_batch(step)), opt, sched, range(STEPS))
    return {k: v.detach().clone() for k, v in model.named_parameters()}, seen


def _saved(obj):
    """A round trip through bytes, as a checkpoint on disk would be."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _rank_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in WRAPPERS:
        for name, make_sched in SCHEDULERS.items():
            model = GPT.from_config_seed(CONFIG, 0)
            runner, opt = _wrap(kind, model)
            sched = make_sched(opt)
            seen = _train(runner, opt, sched, range(STEPS), rank, world)
            out[kind, name] = dict(params=_params(runner, model), seen=seen)

        # Resume: 2 steps, save, a fresh model, wrapper and scheduler load it, 2 more steps.
        model = GPT.from_config_seed(CONFIG, 0)
        runner, opt = _wrap(kind, model)
        sched = SCHEDULERS["step"](opt)
        _train(runner, opt, sched, range(2), rank, world)
        ckpt = _saved(dict(params=_params(runner, model), opt=opt.state_dict(), sched=sched.state_dict()))
        del runner, opt, sched
        model = GPT.from_config_seed(CONFIG, 1)  # other numbers: everything comes from ckpt
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(ckpt["params"][k])
        runner, opt = _wrap(kind, model)
        sched = SCHEDULERS["step"](opt)
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        _train(runner, opt, sched, range(2, STEPS), rank, world)
        out[kind, "resumed"] = _params(runner, model)

    # bad input on a ZeroOptimizer
    model = GPT.from_config_seed(CONFIG, 0)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=LR)
    errors = {}
    other = opt.state_dict()
    other["zero"] = dict(other["zero"], dp_rank=1 - rank)  # the other rank's shard
    for what, call in (("load", lambda: opt.load_state_dict(other)),
                       ("group", lambda: opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]}))):
        try:
            call()
        except ValueError as e:
            errors[what] = str(e)
    out["errors"] = errors
    out["is_optimizer"] = isinstance(opt, torch.optim.Optimizer)
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(_rank_body, 2, timeout=TIMEOUT, quiet=True)


@pytest.mark.parametrize("kind", WRAPPERS)
@pytest.mark.parametrize("sched_name", list(SCHEDULERS))
def test_scheduler_drives_the_inner_step(ranks, kind, sched_name):
    want_params, want_seen = _one_process(sched_name)
    for res in ranks:
        got = res[kind, sched_name]
        # the scheduler really moved lr, and the inner optimizer reads what it wrote
        lrs = [lr for lr, _, _ in got["seen"]]
        assert len(set(lrs)) > 1, lrs
        assert [(lr, last) for lr, last, _ in got["seen"]] == [(lr, last) for lr, last, _ in want_seen]
        assert [betas for _, _, betas in got["seen"]] == [betas for _, _, betas in want_seen]
        adamw_weights(STEPS, max(lrs)).assert_weights(got["params"], want_params, f"{kind} {sched_name}")


@pytest.mark.parametrize("kind", WRAPPERS)
def test_state_dict_round_trip_continues_the_run(ranks, kind):
    for res in ranks:
        uninterrupted = res[kind, "step"]["params"]
        for k, v in uninterrupted.items():
            # the same operations on the same numbers: bit for bit
            assert torch.equal(res[kind, "resumed"][k], v), k


def test_zero_optimizer_is_an_optimizer_and_explains_bad_state(ranks):
    for rank, res in enumerate(ranks):
        assert res["is_optimizer"]
        assert f"shard of dp_rank={1 - rank} of dp_size=2" in res["errors"]["load"]
        assert f"this optimizer is dp_rank={rank} of dp_size=2" in res["errors"]["load"]
        assert "one group" in res["errors"]["group"]
