"""Pipeline parallelism trains exactly like one process, and like torch.distributed.pipelining.

For pp = 2 and 4, every schedule (naive, GPipe, 1F1B, interleaved with 2 chunks
per rank) and m = 1, 4, 8 micro-batches: the loss, the gradients of the first
step and the parameters after several AdamW steps equal those of the plain GPT
trained on the full batch in one process. Variants cover an untied model cut
by parameter count with the embedding (and the head) on stages of their own,
frozen parameters, uneven splits and activation checkpointing.

One `launch` per pipeline size runs every case; the ranks return their
stages' tensors by the model's own parameter names and the comparison happens
here, against one single-process run per model variant.
"""
import functools

import pytest
import torch

from reference.data import synthetic_batch
from reference.model import GPT, GPTConfig, lm_loss
from reference.runtime import launch
from reference.tolerance import adamw_weights, gradient, loss
from reference.train.single import accumulated_step

CFG = dict(n_layer=8, n_head=2, n_embd=16, block_size=8, vocab_size=64)
B, T, STEPS = 8, 8, 3
# Tolerances: the course's policy (reference.tolerance says why). Losses: `loss()`; the
# first step's gradients, summed over m micro-batches (and the tied embedding's two
# stages): `gradient(m + 1)`; parameters after STEPS AdamW steps: `adamw_weights(STEPS, LR)`,
# every weight and the means (over a rank's and over each tensor). Adam divides every
# gradient by its own running size: a gradient that is zero in exact arithmetic (the key
# bias of attention: softmax ignores a shift shared by all keys) is rounding noise,
# different on one process and on a pipeline, and can move its parameter by a whole step
# either way; that is what the bound on any one weight allows. The means are what a wrong
# gradient would move.
LR = 1e-3
KINDS = ("naive", "gpipe", "1f1b", "interleaved")
MS = (1, 4, 8)
FROZEN = ("wpe.weight", "h.1.ln_1.weight", "h.6.ffn.c_fc.bias")
LOSS_TOL, WEIGHT_TOL = loss(), adamw_weights(STEPS, LR)



def _config(tied):
    return GPTConfig.tiny(tie_weights=tied, **CFG)


def _model(tied, frozen):
    model = GPT.from_config_seed(_config(tied), seed=0)
    if frozen:
        for name, p in model.named_parameters():
            if name in FROZEN:
                p.requires_grad_(False)
    return model


def _optimizer(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=LR, weight_decay=0.1)


@functools.lru_cache(maxsize=None)
def _reference(tied, frozen):
    """One process, full batch (`accumulated_step`): losses, first-step gradients, final parameters."""
    model = _model(tied, frozen)
    opt = _optimizer(model.parameters())
    losses, grads = [], None
    for step in range(STEPS):
        x, y = synthetic_batch(B, T, CFG["vocab_size"], seed=1, step=step)
        losses.append(accumulated_step(model, opt, x, y)[0])
        if step == 0:  # the step's gradients stay in .grad after the step
            grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)
                     if p.grad is not None}
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, grads, params


def _cases(pp):
    """(key, schedule args, stage args, model args, checkpoint) for every case of this pp."""
    cases = [((kind, m), dict(kind=kind, m=m, virtual=2 if kind == "interleaved" else 1),
              {}, dict(tied=True, frozen=False), False)
             for kind in KINDS for m in MS]
    # untied, cut by parameters, embedding (and head) alone, frozen parameters, recomputation
    split = dict(balance="params", embedding_stage=True, head_stage=pp >= 4)
    cases.append((("variant", "1f1b"), dict(kind="1f1b", m=4, virtual=1), split,
                  dict(tied=False, frozen=True), True))
    # tied, uneven layer counts (8 blocks over 3 block stages), checkpointing only some chunks
    cases.append((("variant", "interleaved"), dict(kind="interleaved", m=pp, virtual=2),
                  dict(embedding_stage=True), dict(tied=True, frozen=True), [True, False]))
    return cases


def _train(mesh, tied_group, case):
    """Train one case for STEPS steps on this rank's stages; what to compare."""
    from reference.pipeline_parallel import build_schedule, local_stages, run_pipeline, split_stages

    _, sched_args, split_args, model_args, ckpt = case
    pp = mesh.pp
    schedule = build_schedule(pp=pp, **sched_args)
    model = _model(**model_args)
    stages = local_stages(split_stages(model, pp, sched_args["virtual"], **split_args),
                          pp, mesh.pp_rank)
    opt = _optimizer([p for s in stages for p in s.parameters()])
    losses, grads = [], None
    for step in range(STEPS):
        x, y = synthetic_batch(B, T, CFG["vocab_size"], seed=1, step=step)
        opt.zero_grad(set_to_none=True)
        result = run_pipeline(schedule, stages, x, y, group=mesh.pp_group,
                              tied_group=tied_group, checkpoint=ckpt)
        losses.append(result.loss)
        if step == 0:
            grads = {n: p.grad.clone() for s in stages for n, p in s.named_parameters()
                     if p.grad is not None}
        opt.step()
    params = {n: p.detach().clone() for s in stages for n, p in s.named_parameters()}
    return dict(losses=losses, grads=grads, params=params, model=model_args,
                last=mesh.pp_rank == pp - 1, m=sched_args["m"])


# On 4 ranks, also a pipeline of 2 inside each of 2 data-parallel replicas (same
# batch on both): pipeline groups [0, 2] and [1, 3], so the messages go between
# group ranks that are not the global ones.
PP2_DP2 = (("pp2 x dp2", "1f1b"), dict(kind="1f1b", m=4, virtual=1), {},
           dict(tied=True, frozen=False), False)


def _train_body(pp, with_torch):
    import torch.distributed as dist

    from reference.mesh import Mesh
    from reference.pipeline_parallel import build_embedding_group

    mesh = Mesh(pp=pp).build_groups()
    tied_group = build_embedding_group(mesh)
    out = {case[0]: _train(mesh, tied_group, case) for case in _cases(pp)}
    if with_torch:
        out["torch"] = _torch_pipelining(pp, mesh, tied_group)
    if pp == 4:
        mesh2 = Mesh(pp=2, dp=2).build_groups()
        out[PP2_DP2[0]] = _train(mesh2, build_embedding_group(mesh2), PP2_DP2)
    dist.barrier()
    return out


def _torch_pipelining(pp, mesh, tied_group):
    """Same stage modules, same data: our GPipe and 1F1B against PyTorch's (m = 4)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from reference.pipeline_parallel import (build_schedule, local_stages, run_pipeline,
                                             split_stages, sync_tied_grads)

    class OutputOnly(torch.nn.Module):
        """torch's stages pass one tensor; a dense GPTStage's aux loss is zero."""

        def __init__(self, stage):
            super().__init__()
            self.stage = stage

        def forward(self, x):
            return self.stage(x)[0]

    x, y = synthetic_batch(B, T, CFG["vocab_size"], seed=1, step=0)
    compared = {}
    for kind, torch_schedule in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        ours = local_stages(split_stages(_model(True, False), pp), pp, mesh.pp_rank)[0]
        result = run_pipeline(build_schedule(kind, pp, 4), [ours], x, y, group=mesh.pp_group,
                              tied_group=tied_group)
        theirs = local_stages(split_stages(_model(True, False), pp), pp, mesh.pp_rank)[0]
        stage = PipelineStage(OutputOnly(theirs), mesh.pp_rank, pp, torch.device("cpu"),
                              group=mesh.pp_group)
        schedule = torch_schedule(stage, 4, loss_fn=lm_loss)  # grads scaled by 1/m, as ours
        losses = []
        if mesh.pp_rank == 0:
            schedule.step(x)
        elif mesh.pp_rank == pp - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        sync_tied_grads(theirs, tied_group)  # torch's schedules leave tied weights to the user
        compared[kind] = dict(
            loss=(result.loss, torch.stack(losses).mean() if losses else None),
            grads={n: (p.grad, dict(theirs.named_parameters())[n].grad)
                   for n, p in ours.named_parameters()})
    return compared


@functools.lru_cache(maxsize=None)
def _run(pp):
    return launch(_train_body, pp, pp, pp == 2, timeout=240, quiet=True)


def _check_rank_results(results, pp):
    seen = {}
    for rank, out in enumerate(results):
        for key, got in out.items():
            if key == "torch":
                continue
            ref_losses, ref_grads, ref_params = _reference(**got["model"])
            where = f"pp={pp} rank {rank} {key}"
            if got["last"]:
                LOSS_TOL.assert_losses(got["losses"], ref_losses, f"{where} losses")
            else:
                assert got["losses"] == [None] * STEPS, where
            assert set(got["grads"]) == {n for n in got["params"] if n in ref_grads}, where
            grad_tol = gradient(got["m"] + 1)  # m micro-batches, and the tied embedding's copy
            for name, g in got["grads"].items():
                grad_tol.assert_close(g, ref_grads[name], f"{where} grad {name}")
            WEIGHT_TOL.assert_weights(got["params"], {n: ref_params[n] for n in got["params"]},
                                      f"{where} after {STEPS} AdamW steps")  # this rank's stages
            seen.setdefault(key, set()).update(got["params"])
    return seen


@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_trains_like_one_process(pp):
    seen = _check_rank_results(_run(pp), pp)
    # every case ran and, over all ranks, covered every parameter of its model
    cases = _cases(pp) + ([PP2_DP2] if pp == 4 else [])
    assert set(seen) == {key for key, *_ in cases}
    for key, names in seen.items():
        model_args = next(c[3] for c in cases if c[0] == key)
        _, _, ref_params = _reference(**model_args)
        assert names == set(ref_params), f"pp={pp} {key}: not covered {set(ref_params) - names}"


def test_frozen_parameters_stay_put():
    """A frozen parameter gets no gradient and does not move, on its stage."""
    results = _run(2)
    _, _, ref_params = _reference(tied=False, frozen=True)
    init = dict(_model(False, True).named_parameters())
    checked = 0
    for out in results:
        got = out[("variant", "1f1b")]
        for name in set(FROZEN) & set(got["params"]):
            assert name not in got["grads"]
            assert torch.equal(got["params"][name], init[name].detach())
            checked += 1
    assert checked == len(set(FROZEN) & set(ref_params))


def test_equals_torch_distributed_pipelining():
    results = _run(2)
    for rank, out in enumerate(results):
        for kind, got in out["torch"].items():
            mine, theirs = got["loss"]
            if rank == 1:
                LOSS_TOL.assert_close(mine, theirs, f"{kind} loss against torch's")
            else:
                assert mine is None and theirs is None
            assert got["grads"], f"rank {rank} {kind} compared no gradients"
            for name, (g_mine, g_theirs) in got["grads"].items():  # 4 micro-batches and the tied copy
                gradient(5).assert_close(g_mine, g_theirs, f"rank {rank} {kind} {name}")
