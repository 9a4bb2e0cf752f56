"""Weight decay by parameter group survives every wrapper: the 3D trainer's optimizer
(`ParallelGPT.make_optimizer`) decays what the single-process trainer's does.

`reference.train.single.make_optimizer` decays the matrices (dim >= 2) and not the biases
and LayerNorm gains (dim < 2), GPT-2's rule. `pm.make_optimizer(..., weight_decay=wd)`
builds the same groups for zero stages 0 (torch's optimizer), 1 and 2 (`ZeroOptimizer`,
which applies the groups' decay itself on its flat shard); ZeRO-3 with dp > 1 refuses a
decay > 0 with its reason. Before, the 3D trainer decayed every parameter: the LayerNorm
gains (1.0) lost lr * wd = 1e-3 a step.

Tolerance: the course's policy for weights after AdamW steps, `adamw_weights(STEPS, LR)`
(`reference.tolerance`): every weight, the mean difference over all of them and each
tensor's mean. The data-parallel gradient is averaged in another order than the single
process's, and a gradient near zero can take AdamW's whole step either way, so the largest
difference says little. A decay applied where it should not be moves only the biases and
gains, under 3 % of the weights, and averages out over the whole model; each tensor's mean
is what catches it (a LayerNorm gain's 32 weights lose 3 lr wd).
"""
from __future__ import annotations

import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.runtime import launch
from reference.tolerance import adamw_weights, exact
from reference.train.single import accumulated_step

pytestmark = pytest.mark.timeout(300)

CFG = GPTConfig.tiny()
LR, EPS, WD, BETAS, STEPS = 1e-2, 1e-6, 0.1, (0.9, 0.95), 3
B, T = 8, 16
WEIGHTS = adamw_weights(STEPS, LR, betas=BETAS)


def _batches():
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, CFG.vocab_size, (STEPS, B, T + 1), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def _single_process():
    from reference.train.single import make_optimizer
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = make_optimizer(model, LR, weight_decay=WD, betas=BETAS, eps=EPS)
    assert [g["weight_decay"] for g in opt.param_groups] == [WD, 0.0]
    for x, y in _batches():
        accumulated_step(model, opt, x, y)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank():
    import torch.distributed as dist
    from reference.parallel import ParallelConfig
    from reference.parallel.gather import full_state_dict
    from reference.parallel.parallelize import parallelize
    from reference.parallel.step import train_step

    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        config = ParallelConfig(dp=2, zero_stage=stage)
        pm = parallelize(GPT(CFG), config.mesh().build_groups(), config, batch=(B, T))
        try:
            opt = pm.make_optimizer(torch.optim.AdamW, weight_decay=WD, lr=LR, betas=BETAS, eps=EPS)
        except ValueError as e:
            out[stage] = str(e)
            continue
        for x, y in _batches():
            train_step(pm, opt, x, y)
        state = full_state_dict(pm)
        if stage in (1, 2):
            # A round trip of the state keeps the decay where it was (the inner group's 0).
            opt.load_state_dict(opt.state_dict())
            out[stage, "decays"] = (opt.param_groups[0]["weight_decay"], getattr(opt, "weight_decays", None))
        out[stage] = state if dist.get_rank() == 0 else None
    try:
        out["sgd"], out["refused"] = _zero_sgd_groups()
    except (TypeError, ValueError) as e:
        out["sgd"], out["refused"] = repr(e), None
    return out


def _zero_sgd_groups():
    from reference.zero import ZeroOptimizer

    # Coupled L2 decay (SGD with momentum) through ZeroOptimizer's groups, against torch's SGD.
    torch.manual_seed(0)
    model, ref = GPT(CFG), GPT(CFG)
    ref.load_state_dict(model.state_dict())

    def groups(m):
        ps = list(m.parameters())
        return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": WD},
                {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]
    zero = ZeroOptimizer(groups(model), torch.optim.SGD, stage=1, lr=0.1, momentum=0.9)
    sgd = torch.optim.SGD(groups(ref), lr=0.1, momentum=0.9)
    for x, y in _batches():  # every rank the same batch: the averaged gradient is the same
        zero.zero_grad()
        model(x, y)[1].backward()
        zero.step()
        accumulated_step(ref, sgd, x, y)  # one process, torch's SGD
    pairs = [(a.detach().clone(), b.detach().clone()) for a, b in zip(model.parameters(), ref.parameters())]
    # Groups differing in anything but weight_decay are refused, with the key named.
    try:
        ZeroOptimizer([{"params": [model.lm_head.weight], "lr": 0.1},
                       {"params": [model.ln_f.weight], "lr": 0.2}], torch.optim.AdamW)
        return pairs, None
    except ValueError as e:
        return pairs, str(e)


@pytest.fixture(scope="module")
def ranks():
    return launch(_rank, 2, timeout=240, quiet=True)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_3d_optimizer_decays_what_the_single_process_trainer_decays(ranks, stage):
    want, got = _single_process(), ranks[0][stage]
    if stage:  # ZeroOptimizer's inner group decays nothing; its groups' decays are kept apart
        assert all(r[stage, "decays"] == (0.0, [0.0, WD]) for r in ranks)
    if "lm_head.weight" not in got:  # tied to wte: one tensor
        want = {n: v for n, v in want.items() if n != "lm_head.weight"}
    WEIGHTS.assert_weights(got, want, f"zero {stage}")


def test_zero3_refuses_a_weight_decay_with_its_reason(ranks):
    for r in ranks:
        assert "weight_decay=0.1 with zero_stage=3" in r[3] and "LayerNorm" in r[3]


def test_zero_optimizer_groups_apply_coupled_decay_as_torch_sgd(ranks):
    for r in ranks:
        assert not isinstance(r["sgd"], str), r["sgd"]
        # every rank the same batch (an exact mean), and torch's SGD on the flat shard: the
        # same elementwise arithmetic, bit for bit
        for a, b in r["sgd"]:
            exact().assert_close(a, b, "ZeroOptimizer's SGD against torch's")
        assert "may differ only in weight_decay" in r["refused"] and "'lr'" in r["refused"]
