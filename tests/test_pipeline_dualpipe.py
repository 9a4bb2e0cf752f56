"""DualPipe in two directions (`reference.pipeline_parallel.dualpipe`), against DeepSeek's code and README.

* The schedule as data: every rank's compute order is ``DualPipe.step``'s eight steps, transcribed
  here from DeepSeek's code (their counts, which backwards are split into I and W, the W's first
  in first out), micro-batch i in direction i mod 2; the pairs `overlap_pairs` marks are the ones
  DeepSeek's ``_forward_backward_chunk`` runs (its step 4, the middle ranks' first apart, and 5);
  DualPipe's asserts (p even, m even, m >= 2 p) refused with the reason.
* DualPipe's README table, from the course's simulator: with each F&B pair one action, the most
  idle rank idles (PP/2 - 1)(F&B + B - 3W), PP = p stages; every rank holds PP + 1 chunk
  micro-batches (1F1B's first rank PP); every rank holds 2x 1F1B's parameters.
* Equal to one process, one launch of 4 gloo ranks: pp = 4, m = 8 with its pairs one after the
  other and overlapped (`overlap_pairs`), pp = 2, m = 4 (two pipelines side by side) overlapped on
  an untied model with frozen parameters; losses, gradients, and weights after 3 AdamW steps;
  the two copies of each weight equal after them.
"""
import functools

import pytest
import torch

from paired_idle import paired_idle
from reference.data import synthetic_batch
from reference.model import GPT, GPTConfig
from reference.pipeline_parallel import (DualPipeSchedule, build_schedule, local_stages, overlap_pairs,
                                         split_stages)
from reference.pipeline_parallel.multistep import dualpipe_readme_bubble
from reference.runtime import launch
from reference.tolerance import adamw_weights, gradient, loss

CFG = dict(n_layer=8, n_head=2, n_embd=16, block_size=8, vocab_size=64)
B, T, STEPS, LR = 8, 8, 3, 1e-3
FROZEN = ("wpe.weight", "h.1.ln_1.weight", "h.6.ffn.c_fc.bias")
SHAPES = [(2, 4), (2, 6), (4, 8), (4, 10), (4, 12), (6, 12), (8, 16), (8, 20)]


def _deepseek_step(pp: int, m: int, rank: int) -> list[tuple]:
    """``DualPipe.step``'s compute on ``rank``, transcribed from DeepSeek's code: (op, phase), a
    backward with ``enable_zb`` an I whose W waits in a queue (first in, first out)."""
    half, h, n = pp // 2, min(rank, pp - 1 - rank), m // 2
    out, queue = [], []

    def f(phase):
        out.append(("F", phase))

    def b(phase, zb=False):
        out.append(("I" if zb else "B", phase))
        queue.extend([phase] if zb else [])

    def w():
        out.append(("W", queue.pop(0)))

    for _ in range(2 * (half - h - 1)):  # step 1: nF0
        f(0)
    for _ in range(h + 1):               # step 2: nF0F1
        f(0), f(1)
    for _ in range(half - h - 1):        # step 3: nB1W1F1
        b(1, True), w(), f(1)
    for _ in range(n - pp + h + 1):      # step 4: nF0B1F1B0
        f(0), b(1), f(1), b(0)
    for _ in range(half - h - 1):        # step 5: nB1F1B0
        b(1), f(1), b(0)
    zb = False
    for i in range(h + 1):               # step 6: nB1B0, the second half split
        zb = zb or (i == (h + 1) // 2 and h % 2 == 1)
        b(1, zb)
        zb = zb or (i == (h + 1) // 2 and h % 2 == 0)
        b(0, zb)
    for _ in range(half - h - 1):        # step 7: nWB0
        w(), b(0, True)
    for _ in range(h + 1):               # step 8: nW
        w()
    assert not queue
    return out


@pytest.mark.parametrize("pp,m", SHAPES)
def test_the_order_is_deepseeks(pp, m):
    s = build_schedule("dualpipe", pp, m, virtual=2)  # validated: complete, no deadlock
    assert isinstance(s, DualPipeSchedule) and s.n_stages == 2 * pp
    for r in range(pp):
        work = [a for a in s.actions(r) if a.op in "FBIW"]
        second_half = r >= pp // 2  # DeepSeek's phase: 0 is the direction the rank is early in
        assert [(a.op, a.chunk ^ second_half) for a in work] == _deepseek_step(pp, m, r), (pp, m, r)
        for ops in ("F", "IB"):  # each direction's micro-batches in order: i in direction i mod 2
            for d in (0, 1):
                mbs = [a.mb for a in work if a.op in ops and a.chunk == d]
                assert mbs == list(range(d, m, 2)), (pp, m, r, ops, d)
        assert [s.model_stage(s.stage(r, c)) for c in (0, 1)] == [r, pp - 1 - r]


@pytest.mark.parametrize("pp,m", SHAPES)
def test_the_pairs_are_deepseeks(pp, m):
    s = overlap_pairs(build_schedule("dualpipe", pp, m, virtual=2))  # validated
    for r in range(pp):
        h = min(r, pp - 1 - r)
        step_4, step_5, middle = m // 2 - pp + h + 1, pp // 2 - h - 1, h == pp // 2 - 1
        assert len(s.pairs[r]) == 2 * step_4 - middle + step_5, (pp, m, r)
        pairs = [st for st in s.steps(r) if len(st) == 2 and not st[0].is_comm]
        assert all(f.op == "F" and b.op == "B" and f.chunk != b.chunk for f, b in pairs)


def test_deepseeks_asserts_are_refused_with_the_reason():
    for pp, m in ((3, 6), (4, 7), (4, 6)):
        with pytest.raises(ValueError, match="even pp and an even m >= 2 pp"):
            build_schedule("dualpipe", pp, m, virtual=2)
    with pytest.raises(ValueError, match="virtual must be 2"):
        build_schedule("dualpipe", 4, 8)
    with pytest.raises(ValueError, match="tied_group=None"):
        build_schedule("dualpipe", 2, 4, 2).sum_copies([], tied_group=object())


def test_the_readme_bubble_and_memory():
    """DualPipe's README row, PP = p stages, chunk times F = I = W = 1 (B = 2): the most idle rank
    idles (PP/2 - 1)(F&B + B - 3W) for a pair that hides all, half or none of its work; run as
    the course runs a pair by default (F, then B), 1F1B's and DualPipeV's units. Memory: PP + 1
    chunk micro-batches held on every rank (1F1B: PP on its first), 2x 1F1B's parameters."""
    for pp, m in SHAPES:
        s = build_schedule("dualpipe", pp, m, virtual=2)
        for t_fb in (2.0, 2.5, 3.0):
            row = dualpipe_readme_bubble("dualpipe", pp, 1.0, 2.0, 1.0, t_fb)
            assert max(paired_idle(s, 1.0, 1.0, 1.0, t_fb)) == row, (pp, m, t_fb)
        assert [s.peak_in_flight(r) for r in range(pp)] == [pp + 1] * pp
        assert build_schedule("1f1b", pp, m).peak_in_flight(0) == pp
    # pp = 8, m = 20 (the README's figure), F&B = F + B = 3: (8/2 - 1)(3 + 2 - 3) = 6 on every rank
    assert paired_idle(build_schedule("dualpipe", 8, 20, 2), 1.0, 1.0, 1.0, 3.0) == [6.0] * 8
    # the simulator's bubble, a chunk a whole stage (F = I = W = 1 per stage), pairs run F then B
    assert round(build_schedule("dualpipe", 4, 8, 2).bubble_fraction(1, 2, 1), 4) == 0.04
    # parameters: rank r holds stages r and p - 1 - r, twice 1F1B's over the ranks
    model = GPT.from_config_seed(GPTConfig.tiny(tie_weights=False, **CFG), seed=0)
    for pp in (2, 4, 8):
        s = build_schedule("dualpipe", pp, 2 * pp, 2)
        count = [sum(p.numel() for st in local_stages(split_stages(model, pp), pp, r, s) for p in st.parameters())
                 for r in range(pp)]
        one = [sum(p.numel() for p in st.parameters()) for st in split_stages(model, pp)]
        assert count == [one[r] + one[pp - 1 - r] for r in range(pp)] and sum(count) == 2 * sum(one)


# ---------------------------------------------------------------------------
# Equal to one process: one launch of 4 ranks
# ---------------------------------------------------------------------------
def _model(tied, frozen):
    model = GPT.from_config_seed(GPTConfig.tiny(tie_weights=tied, **CFG), seed=0)
    for name, p in model.named_parameters():
        if frozen and name in FROZEN:
            p.requires_grad_(False)
    return model


def _optimizer(params):
    """AdamW over the distinct parameters (ranks 0 and p - 1 hold both ends of the tied embedding)."""
    return torch.optim.AdamW(list({id(p): p for p in params if p.requires_grad}.values()), lr=LR,
                             weight_decay=0.1)


CASES = {"pp4": (4, 8, False, dict(tied=True, frozen=False)),
         "pp4-overlap": (4, 8, True, dict(tied=True, frozen=False)),
         "pp2-overlap": (2, 4, True, dict(tied=False, frozen=True))}


def _train(mesh, case):
    from reference.pipeline_parallel import run_pipeline

    pp, m, overlapped, model_args = CASES[case]
    schedule = build_schedule("dualpipe", pp, m, virtual=2)
    schedule = overlap_pairs(schedule) if overlapped else schedule
    stages = local_stages(split_stages(_model(**model_args), pp), pp, mesh.pp_rank, schedule)
    opt = _optimizer([p for st in stages for p in st.parameters()])
    losses, grads = [], None
    for step in range(STEPS):
        x, y = synthetic_batch(B, T, CFG["vocab_size"], seed=1, step=step)
        opt.zero_grad(set_to_none=True)
        result = run_pipeline(schedule, stages, x, y, group=mesh.pp_group)
        losses.append(result.loss)
        if step == 0:
            grads = {n: p.grad.clone() for st in stages for n, p in st.named_parameters() if p.grad is not None}
        opt.step()
    return dict(losses=losses, grads=grads, order=[e.action for e in result.trace], pp_rank=mesh.pp_rank,
                pipeline=mesh.group_ranks_of(mesh.rank, "pp"),
                params={n: p.detach().clone() for st in stages for n, p in st.named_parameters()})


def _body():
    import torch.distributed as dist

    from reference.mesh import Mesh

    out = {}
    for pp in (4, 2):  # pp = 2: two pipelines side by side (their dp groups left unused)
        mesh = Mesh(pp=pp, dp=4 // pp).build_groups()
        out.update({case: _train(mesh, case) for case in CASES if CASES[case][0] == pp})
    dist.barrier()
    return out


@functools.lru_cache(maxsize=None)
def _run():
    return launch(_body, 4, timeout=240, quiet=True)


@functools.lru_cache(maxsize=None)
def _one_process(tied, frozen, m):
    from reference.train.single import accumulate_gradients, accumulated_step

    model = _model(tied, frozen)
    opt = _optimizer(model.parameters())
    losses, grads = [], None
    for step in range(STEPS):
        x, y = synthetic_batch(B, T, CFG["vocab_size"], seed=1, step=step)
        if step == 0:
            accumulate_gradients(model, x, y, chunks=m)
            grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)
                     if p.grad is not None}
        losses.append(accumulated_step(model, opt, x, y, chunks=m)[0])
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def test_dualpipe_trains_like_one_process():
    results = _run()
    for case, (pp, m, overlapped, model_args) in CASES.items():
        ref_losses, ref_grads, ref_params = _one_process(model_args["tied"], model_args["frozen"], m)
        schedule = build_schedule("dualpipe", pp, m, virtual=2)
        covered = set()
        for rank in range(4):
            got = results[rank][case]
            r, where = got["pp_rank"], f"{case} rank {rank}"
            mirror = results[got["pipeline"][pp - 1 - r]][case]  # rank p - 1 - r: the other copies
            ran, planned = ([a for a in acts if a.op in "FBIW"] for acts in (got["order"], schedule.actions(r)))
            assert (set(ran) == set(planned)) if overlapped else (ran == planned), where  # a pair: B first
            if r in (0, pp - 1):  # each end computes the loss of the micro-batches fed from the other
                losses = [float(x) for x in got["losses"]]
                other = mirror["losses"]  # the other end: the micro-batches fed from here
                loss().assert_losses([a + float(b) for a, b in zip(losses, other)], ref_losses, where)
            else:
                assert got["losses"] == [None] * STEPS, where
            assert set(got["grads"]) == {n for n in got["params"] if n in ref_grads}, where
            for name, g in got["grads"].items():  # m micro-batches, the copies, the tied weight's two ends
                gradient(2 * m + 2).assert_close(g, ref_grads[name], f"{where} grad {name}")
            adamw_weights(STEPS, LR).assert_weights(
                got["params"], {n: ref_params[n] for n in got["params"]}, f"{where} after {STEPS} steps")
            assert got["params"].keys() == mirror["params"].keys()
            assert all(torch.equal(p, mirror["params"][n]) for n, p in got["params"].items()), where
            covered |= set(got["params"])
        assert covered == set(ref_params), f"{case}: not covered {set(ref_params) - covered}"


# ---------------------------------------------------------------------------
# Through ParallelConfig: composed, against one process
# ---------------------------------------------------------------------------
COMPOSED = [  # (config keywords, clip, moe), on 4 ranks
    (dict(dp=2, pp=2, schedule="dualpipe", virtual_stages=2, microbatches=4), True, False),
    (dict(tp=2, pp=2, sequence_parallel=True, schedule="dualpipe", virtual_stages=2, microbatches=4,
          activation_checkpointing=True), True, False),
    (dict(dp=2, ep=2, pp=2, schedule="dualpipe", virtual_stages=2, microbatches=4,
          overlap_forward_backward=True), False, True),  # the pairs overlapped, as DeepSeek runs them
]


def test_parallel_config_names_dualpipe_and_says_what_it_needs():
    from reference.parallel.config import ParallelConfig

    ok = ParallelConfig(pp=4, schedule="dualpipe", virtual_stages=2, microbatches=8)
    assert not ok.problems(4, None, None, None) and ok.n_stages == 4
    overlapped = ok.with_(dp=2, ep=2, overlap_forward_backward=True)  # DualPipe's pairs, as DualPipeV's
    assert not overlapped.problems(8, None, None, 4)
    assert any("at ep=1 there is none" in p for p in overlapped.with_(ep=1).problems(8, None, None, 4))
    for kw, why in ((dict(pp=3, microbatches=6), "even pp and an even microbatches >= 2 pp"),
                    (dict(pp=4, microbatches=6), "even pp and an even microbatches >= 2 pp"),
                    (dict(pp=2, microbatches=4, virtual_stages=1), "needs virtual_stages=2"),
                    (dict(pp=2, dp=2, microbatches=4, zero_stage=1), "use zero_stage=0")):
        kw = dict(dict(schedule="dualpipe", virtual_stages=2), **kw)
        problems = ParallelConfig(**kw).problems(kw["pp"] * kw.get("dp", 1), None, None, None)
        assert any(why in p for p in problems), (kw, problems)


def test_composed_dualpipe_equals_one_process():
    """DualPipe through `ParallelConfig` with dp, tp + SP + recomputation and experts over ep, on 4
    ranks, against `accumulated_step` (the sweep's `single_process`), clipping in two of them."""
    from sweep import SweepCase
    from sweep_run import compare, run_cases, single_process

    from reference.parallel.config import ParallelConfig

    # the experts balanced by a bias too: each copy's loads summed with the other's before the step
    cases = [SweepCase(ParallelConfig(**kw), clip=clip, moe=moe, bias=moe) for kw, clip, moe in COMPOSED]
    assert all(not c.problems() for c in cases), [c.problems() for c in cases]
    ranks = launch(run_cases, 4, cases, timeout=300, quiet=True)
    rows = [compare(case, ranks[0][i], single_process(case)) for i, case in enumerate(cases)]
    assert all(row["ok"] for row in rows), [row for row in rows if not row["ok"]]
