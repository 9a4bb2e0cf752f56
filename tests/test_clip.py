"""reference.parallel.clip: the global gradient norm of a parallel run equals
torch.nn.utils.clip_grad_norm_ on one process holding the whole model's gradients.

For every layout (DDP, ZeRO-1/2, FSDP, TP with sequence parallelism, a 2-stage pipeline
with a tied embedding, and dp x tp together) the ranks compute the model's gradients for
one global batch, clip with `clip_grad_norm_`, and return the norm and their clipped
gradients; the tests compare them with one process that runs the same batch and torch's
clip. MAX_NORM is chosen well below the norm (checked) so that clipping really scales.

Models and batches go to `reference.runtime.device()` (the CPU: the launches here ask for
gloo), so tests/test_gpu.py runs the same bodies and checks on NCCL.

Tolerances: the course's policy (`reference.tolerance`). The gradients are averaged over the
ranks and the ranks' squares summed in another order than torch's per-tensor norms:
`gradient(2)` on two ranks, `gradient(4)` on dp 2 x tp 2 (a LayerNorm's gradient summed over
both). One process through `clip_grad_norm_` is torch's clip bit for bit (`exact()`).
"""
import math

import pytest
import torch

from reference import comms
from reference.data import synthetic_batch
from reference.data_parallel import DDP
from reference.mesh import Mesh
from reference.model import GPT, GPTConfig
from reference.parallel.clip import MARKS, clip_grad_norm_, clip_pieces, flat_grad_pieces, mark_parallel_params
from reference.pipeline_parallel import build_embedding_group, build_schedule, local_stages, run_pipeline, split_stages
from reference.runtime import device, launch
from reference.tolerance import exact, gradient, sgd_weights
from reference.tensor_parallel import allreduce_sequence_parallel_grads, apply_tensor_parallel
from reference.train.single import accumulate_gradients, accumulated_step
from reference.zero import FSDP, ZeroOptimizer
from reference.zero.shard import FlatLayout

from test_tensor_parallel_gpt import dense_shard  # this rank's slice of a dense tensor under TP

TOL = gradient(2)                            # gradients averaged over two ranks
CFG = GPTConfig.tiny()                       # tied embedding; every size splits over 2 ranks
UNEVEN = GPTConfig.tiny(n_embd=9, n_head=3, vocab_size=251)  # 4743 numbers: ZeRO pads to 4744
B, T = 4, 16
MAX_NORM = 0.05


def _batch(cfg=CFG):
    return synthetic_batch(B, T, vocab_size=cfg.vocab_size, seed=3)


def _gpt(cfg=CFG):
    return GPT.from_config_seed(cfg, 0).to(device())


def _rank_batch(cfg=CFG, rank=0, n=1):
    """This rank's rows of the batch, on its device."""
    return tuple(_slice(t, rank, n).to(device()) for t in _batch(cfg))


def _grads(named):
    return {n: p.grad.cpu().clone() for n, p in named}


def _slice(t, rank, n):
    return t.chunk(n)[rank]


def oracle(cfg=CFG):
    """One process, the whole batch (`accumulate_gradients`), torch's clip: (norm before
    clipping, clipped grads by name)."""
    model = GPT.from_config_seed(cfg, 0)
    accumulate_gradients(model, *_batch(cfg))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return norm, {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}


# ----------------------------------------------------------------------- rank bodies
def _ddp(mesh):
    model = _gpt()
    ddp = DDP(model, group=mesh.dp_group)
    ddp(*_rank_batch(CFG, mesh.dp_rank, mesh.dp))[1].backward()  # gradients averaged over dp inside backward
    try:  # bare tensors say nothing of where they live: refused with two ranks
        clip_grad_norm_(list(model.parameters()), MAX_NORM, mesh)
        refused = None
    except ValueError as err:
        refused = str(err)
    with comms.meter() as m:
        norm = clip_grad_norm_(ddp, MAX_NORM, mesh)
    return dict(norm=norm.cpu(), grads=_grads(model.named_parameters()), refused=refused,
                records=m.records())


def _clip_flat(model, opt, mesh):
    """A ZeroOptimizer's reduced shard, cut into pieces by its parameters' marks, clipped."""
    mark_parallel_params(model)
    pieces = flat_grad_pieces(opt.layout, opt.params, opt.dp_rank, opt.shard.grad)
    return clip_pieces(pieces, [opt.shard.grad], MAX_NORM, mesh)


def _zero(mesh, stage):
    model = _gpt(UNEVEN)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, group=mesh.dp_group)
    model(*_rank_batch(UNEVEN, mesh.dp_rank, mesh.dp))[1].backward()
    opt.reduce_gradients()  # each rank: the averaged gradient of its shard (S,), then clip it
    norm = _clip_flat(model, opt, mesh)
    names = {id(p): n for n, p in model.named_parameters()}
    return dict(norm=norm.cpu(), shard_grad=opt.shard.grad.cpu().clone(),
                order=[names[id(p)] for p in opt.params], padding=opt.layout.padding)


def _zero_step(mesh, stage):
    """reduce, clip, then step() with SGD (lr 1: the update is the gradient): step() must
    update with the clipped gradient, not reduce the unclipped one again."""
    model = _gpt(UNEVEN)
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=stage, group=mesh.dp_group, lr=1.0)
    model(*_rank_batch(UNEVEN, mesh.dp_rank, mesh.dp))[1].backward()
    opt.reduce_gradients()
    _clip_flat(model, opt, mesh)
    opt.step()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _fsdp(mesh):
    model = _gpt()
    names = {id(p): n for n, p in model.named_parameters()}
    fsdp = FSDP(model, group=mesh.dp_group)
    fsdp(*_rank_batch(CFG, mesh.dp_rank, mesh.dp))[1].backward()  # each unit reduce-scattered into its shard
    mark_parallel_params(model)
    pieces = [x for u in fsdp.units for x in flat_grad_pieces(u.layout, u.params, u.dp_rank, u.shard.grad)]
    norm = clip_pieces(pieces, [u.shard.grad for u in fsdp.units], MAX_NORM, mesh)
    return dict(norm=norm.cpu(), units=[([names[id(p)] for p in u.params], u.shard.grad.cpu().clone())
                                        for u in fsdp.units])


def _tp(mesh):
    model = apply_tensor_parallel(_gpt(), mesh, sequence_parallel=True)
    if mesh.dp > 1:
        model = DDP(model, group=mesh.dp_group)
    model(*_rank_batch(CFG, mesh.dp_rank, mesh.dp))[1].backward()
    inner = getattr(model, "module", model)
    allreduce_sequence_parallel_grads(inner, mesh.tp_group)  # LayerNorms: sum over the tp ranks' tokens
    norm = clip_grad_norm_(model, MAX_NORM, mesh)
    marks = {n: p.tensor_model_parallel for n, p in inner.named_parameters()}
    return dict(norm=norm.cpu(), grads=_grads(inner.named_parameters()), marks=marks)


def _pp(mesh):
    stages = local_stages(split_stages(_gpt(), mesh.pp), mesh.pp, mesh.pp_rank)
    tied = build_embedding_group(mesh)  # wte on stage 0, its copy as lm_head on stage 1
    x, y = _rank_batch()
    run_pipeline(build_schedule("gpipe", mesh.pp, 2), stages, x, y, group=mesh.pp_group, tied_group=tied)
    norm = clip_grad_norm_(stages, MAX_NORM, mesh)
    named = {n: p for s in stages for n, p in s.named_parameters()}
    return dict(norm=norm.cpu(), grads=_grads(named.items()), shared={n: p.shared for n, p in named.items()})


def _two_ranks():
    out = {}
    for dims, body in ((dict(dp=2), _ddp), (dict(dp=2), lambda m: _zero(m, 1)),
                       (dict(dp=2), lambda m: _zero(m, 2)), (dict(dp=2), _fsdp),
                       (dict(tp=2), _tp), (dict(pp=2), _pp),
                       (dict(dp=2), lambda m: _zero_step(m, 1)), (dict(dp=2), lambda m: _zero_step(m, 2))):
        mesh = Mesh(**dims).build_groups()
        out[len(out)] = body(mesh)
    return dict(zip(("ddp", "zero1", "zero2", "fsdp", "tp", "pp", "zero1_step", "zero2_step"),
                    out.values()))


@pytest.fixture(scope="module")
def two_ranks():
    return launch(_two_ranks, 2, backend="gloo", timeout=180, quiet=True)


@pytest.fixture(scope="module")
def expected():
    norm, grads = oracle()
    assert norm > 4 * MAX_NORM  # clipping scales by less than 1/4: it really happens
    return norm, grads


def _close(got, want, what, tol=TOL):
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------ the tests
def test_ddp_counts_the_replicated_gradient_once(two_ranks, expected):
    check_ddp(two_ranks, expected)


def check_ddp(two_ranks, expected, tol=TOL):
    norm, grads = expected
    for rank, r in enumerate(two_ranks):
        out = r["ddp"]
        _close(out["norm"], norm, f"rank {rank} norm", tol)
        for name, g in out["grads"].items():
            _close(g, grads[name], f"rank {rank} {name}", tol)
        assert "carries no parallel marks" in out["refused"]
        # The whole cost: one all-reduce of one fp32 number over the world.
        assert [(rec["op"], rec["calls"], rec["payload_bytes"]) for rec in out["records"]] == \
            [("all_reduce", 1, 4)]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_clips_the_reduced_shards(two_ranks, stage):
    check_zero(two_ranks, stage)


def check_zero(two_ranks, stage, tol=TOL):
    norm, grads = oracle(UNEVEN)
    assert norm > 4 * MAX_NORM
    for rank, r in enumerate(two_ranks):
        out = r[f"zero{stage}"]
        assert out["padding"] == 1
        _close(out["norm"], norm, f"ZeRO-{stage} rank {rank} norm", tol)
        # The oracle's clipped gradients in the optimizer's flat layout; this rank's shard of them.
        layout = FlatLayout([grads[n].numel() for n in out["order"]], 2)
        flat = layout.flatten([grads[n] for n in out["order"]], torch.empty(layout.padded_numel))
        _close(out["shard_grad"], layout.shard(flat, rank), f"ZeRO-{stage} rank {rank} shard", tol)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_step_after_clipping_uses_the_clipped_gradient(two_ranks, stage):
    """ZeroOptimizer.step() after reduce_gradients() and a clip does not reduce again
    (stage 1 used to reduce-scatter the unclipped gradient a second time)."""
    model = GPT.from_config_seed(UNEVEN, 0)  # one process, torch's clip, SGD with lr 1: p - clipped gradient
    accumulated_step(model, torch.optim.SGD(model.parameters(), lr=1.0), *_batch(UNEVEN), max_norm=MAX_NORM)
    want = {n: p.detach() for n, p in model.named_parameters()}
    for rank, r in enumerate(two_ranks):
        for name, value in r[f"zero{stage}_step"].items():
            _close(value, want[name], f"ZeRO-{stage} rank {rank} {name} after step", sgd_weights(1, 1.0, n=2))


def test_fsdp_clips_every_units_shard(two_ranks, expected):
    check_fsdp(two_ranks, expected)


def check_fsdp(two_ranks, expected, tol=TOL):
    norm, grads = expected
    for rank, r in enumerate(two_ranks):
        out = r["fsdp"]
        _close(out["norm"], norm, f"FSDP rank {rank} norm", tol)
        for names, shard_grad in out["units"]:
            layout = FlatLayout([grads[n].numel() for n in names], 2)
            flat = layout.flatten([grads[n] for n in names], torch.empty(layout.padded_numel))
            _close(shard_grad, layout.shard(flat, rank), f"FSDP rank {rank} unit {names[0]}..", tol)


def test_tensor_parallel_with_sequence_parallel(two_ranks, expected):
    check_tp(two_ranks, expected)


def check_tp(two_ranks, expected, tol=TOL):
    norm, grads = expected
    for rank, r in enumerate(two_ranks):
        out = r["tp"]
        _close(out["norm"], norm, f"TP rank {rank} norm", tol)
        for name, g in out["grads"].items():
            _close(g, dense_shard(name, grads[name], rank, 2, CFG.vocab_size), f"TP rank {rank} {name}", tol)
        # Split tensors count on both ranks, replicated ones once.
        m = out["marks"]
        assert m["h.0.attn.c_attn.weight"] and m["h.0.attn.c_attn.bias"] and m["wte.weight"]
        assert m["h.1.ffn.c_proj.weight"] and not m["h.1.ffn.c_proj.bias"]
        assert not m["h.0.ln_1.weight"] and not m["wpe.weight"]


def test_pipeline_counts_the_tied_embedding_once(two_ranks, expected):
    check_pp(two_ranks, expected)


def check_pp(two_ranks, expected, tol=TOL):
    norm, grads = expected
    for rank, r in enumerate(two_ranks):
        out = r["pp"]
        _close(out["norm"], norm, f"PP rank {rank} norm", tol)
        for name, g in out["grads"].items():  # lm_head.weight on stage 1 is the tied copy
            _close(g, grads[name], f"PP rank {rank} {name}", tol)
    assert two_ranks[1]["pp"]["shared"]["lm_head.weight"]
    assert not two_ranks[0]["pp"]["shared"]["wte.weight"]
    assert sum(s for r in two_ranks for s in r["pp"]["shared"].values()) == 1


def _dp_tp():
    return _tp(Mesh(dp=2, tp=2).build_groups())


def test_data_and_tensor_parallel_together(expected):
    """4 ranks, dp 2 x tp 2 with SP: a LayerNorm is held by all four and counted by one."""
    norm, grads = expected
    mesh, tol = Mesh(dp=2, tp=2), gradient(4)  # a LayerNorm's gradient: summed over dp and tp
    for rank, out in enumerate(launch(_dp_tp, 4, backend="gloo", timeout=180, quiet=True)):
        _close(out["norm"], norm, f"rank {rank} norm", tol)
        tp_rank = mesh.coords(rank).tp
        for name, g in out["grads"].items():
            _close(g, dense_shard(name, grads[name], tp_rank, 2, CFG.vocab_size), f"rank {rank} {name}", tol)


# ------------------------------------------------------------------ one process, bad input
def test_one_process_is_torchs_clip_bit_for_bit():
    model = GPT.from_config_seed(CFG, 0)
    norm, grads = oracle()
    for target in (model, list(model.parameters())):  # modules or tensors, mesh None or of one rank
        for mesh in (None, Mesh()):
            for p in model.parameters():
                p.grad = None
            accumulate_gradients(model, *_batch())  # the oracle's gradients, before its clip
            got = clip_grad_norm_(target, MAX_NORM, mesh)
            exact().assert_close(got, norm, "norm")
            for n, p in model.named_parameters():
                exact().assert_close(p.grad, grads[n], n)


def test_inf_norm_and_no_clipping_below_the_limit():
    model = GPT.from_config_seed(CFG, 0)
    model(*_batch())[1].backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    largest = max(g.abs().max() for g in before.values())
    got = clip_grad_norm_(model, 1e9, norm_type=math.inf)  # far above: nothing changes
    exact().assert_close(got, largest, "inf norm")
    for n, p in model.named_parameters():
        exact().assert_close(p.grad, before[n], n)


def test_marks_and_bad_input_are_named():
    model = GPT.from_config_seed(CFG, 0)
    params = mark_parallel_params(model)
    assert len(params) == len(list(model.parameters()))  # the tied weight once
    assert all(getattr(p, mark) is False for p in params for mark in MARKS)  # a plain GPT: nothing split
    with pytest.raises(ValueError, match="max_norm must be a positive number, got 0"):
        clip_grad_norm_(model, 0)
    with pytest.raises(ValueError, match="norm_type must be 2 or inf, got 1.0"):
        clip_grad_norm_(model, 1.0, norm_type=1)
    with pytest.raises(ValueError, match=r"mesh=.*world_size=4.* but world_size=1"):
        clip_grad_norm_(model, 1.0, Mesh(dp=4))
    with pytest.raises(TypeError, match="got str"):
        clip_grad_norm_(["wte.weight"], 1.0)
