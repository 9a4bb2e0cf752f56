"""Hidden checks of homework 06's composed exercise: finishing one step of a dp x tp x pp run.

``finish_step(grads, layout, loss, groups, dp_reduce=True, max_norm=None)`` runs on every
rank after the pipeline's last backward. It receives this rank's raw gradients, name ->
tensor, each as the rank's own backward left it, and must turn them, in place, into one
process's gradients of the mean loss over the global batch (this rank's slice of them),
then return ``(loss, norm)``: the global mean loss, the same float on every rank, and the
gradient norm of the whole model before clipping (None when ``dp_reduce`` is False).

``layout[name]`` says what the tensor is:

* ``"tp"``: ``"split"`` (this tp rank's slice: column and row-parallel weights, the
  vocabulary-parallel embedding and head), ``"replicated"`` (the same numbers on every tp
  rank of the stage: LayerNorms and row-parallel biases without sequence parallelism) or
  ``"partial"`` (the same parameter on every tp rank, but each rank's gradient covers only
  its T / tp tokens: LayerNorms and row-parallel biases with sequence parallelism);
* ``"tied"``: True for each of the two copies of a tied embedding that live on different
  stages (the first stage's ``wte.weight``, the last stage's ``lm_head.weight``); each
  copy's gradient is that use's alone.

``loss`` is the rank's mean loss over its micro-batches on the last stage, None elsewhere.
``groups`` holds the rank's ``"dp"``, ``"tp"`` and ``"pp"`` groups and ``"embedding"`` (the
first and last stage of this pipeline, None on a middle stage or where nothing is tied).
With ``dp_reduce`` False a distributed optimizer will reduce-scatter the gradients over dp
and average them itself: the function must leave dp alone (no norm then). With
``max_norm`` the gradients are clipped by the global norm with torch's coefficient
``min(1, max_norm / (norm + 1e-6))``. Only ``all_reduce`` and ``broadcast`` are allowed.

The cases come from a real GPT: the grader computes each dp replica's gradient of its own
rows in one process (float64), cuts it as `parallelize` does (blocks dealt out to the
stages, the extra ones on the later stages; the embedding on the first stage and its copy
on the last; the tp slices along the dimension each layer splits) and splits what a rank
sees only part of into random parts that sum to it (sequence-parallel tokens, the tied
embedding's two uses); the ranks get float32. Expected (`expect_finish_step`, computed in
float64 from those float32 parts, so that the ranks never receive the answer): the slice
of the mean of the replicas' gradients, which is one process's gradient of the whole batch
(the tests check it against the GPT's), clipped; the mean loss; the norm. Compared with
the course's bounds (reasoned in reference/tolerance.py): the gradients within
`gradient(n).at_scale(s)`, a sum over at most n = world size parts in another order, s
the largest |part| of the tensor that any rank holds (a rank sums the parts in float32,
which moves an element by a few ulps of the largest part, not of the element); the loss
within `loss()`; the norm, a sum of squares over the ranks, within `gradient(n)`.
Cases on 4, 6 and 8 ranks: dp x tp with sequence parallelism, tp x pp and dp x pp with a
tied embedding, a middle stage (pp = 3), dp x tp x pp tied and untied, clipping that acts
and clipping that does not, and `dp_reduce` False (each rank's gradient must stay its own
replica's). Each mistake of notebook 06's composition clinic (the sequence-parallel
gradients not summed over tp, the tied copies drifting, the loss averaged over pp,
replicated tensors counted tp times in the norm, dp averaged when the optimizer will
average) fails the cases it can be seen on.
"""
from __future__ import annotations

import math

import torch

from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.parallel_step_rank import call_finish_step, torch_finish_step
from reference.course.homework.scoring import Case, ExerciseSpec
from reference.tolerance import Tolerance, exact, gradient, loss as loss_tolerance

__all__ = ["FINISH_STEP", "make_finish_cases", "expect_finish_step", "judge_finish_step"]

# The cases' meshes, (dp, tp, pp, sequence_parallel, tied, dp_reduce, clip), by world size.
# clip: None (no clipping), "acts" (max_norm half the norm) or "idle" (ten times the norm).
MESHES = {
    4: [("dp 2 x tp 2, sequence parallel", (2, 2, 1, True, True, True, None)),
        ("tp 2 x pp 2, tied, clipped", (1, 2, 2, False, True, True, "acts")),
        ("dp 2 x pp 2, tied, the optimizer averages dp", (2, 1, 2, False, True, False, None)),
        ("dp 4, a clip that does not act", (4, 1, 1, False, True, True, "idle"))],
    6: [("tp 2 x pp 3, tied, sequence parallel, clipped", (1, 2, 3, True, True, True, "acts"))],
    8: [("dp 2 x tp 2 x pp 2, sequence parallel, tied, clipped", (2, 2, 2, True, True, True, "acts")),
        ("dp 2 x tp 2 x pp 2, sequence parallel, untied, the optimizer averages dp",
         (2, 2, 2, True, False, False, None))],
}
_SP_NAMES = ("ln_1.", "ln_2.", "ln_f.", "attn.c_proj.bias", "ffn.c_proj.bias")


def _tp_dim(name: str):
    """The dimension tensor parallelism splits (None: the same tensor on every tp rank)."""
    if name in ("wte.weight", "lm_head.weight") or ".c_attn." in name or ".c_fc." in name:
        return 0
    if name.endswith("c_proj.weight"):
        return 1
    return None


def _stage_of(name: str, n_layer: int, pp: int):
    """The stages holding `name`: blocks dealt out with the extra ones on the later stages."""
    if name.startswith(("wte.", "wpe.")):
        return [0]
    if name.startswith(("ln_f.", "lm_head.")):
        return [pp - 1]
    block = int(name.split(".")[1])
    sizes = [n_layer // pp + (s >= pp - n_layer % pp) for s in range(pp)]
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [max(s for s in range(pp) if starts[s] <= block)]


def _case_model(generator, dp: int, tie: bool, n_layer: int, vocab: int):
    """A float64 GPT of the case's shape and its global batch, dp x 2 rows of 8 tokens."""
    from reference.model import GPT, GPTConfig

    config = GPTConfig(vocab_size=vocab, block_size=8, n_layer=n_layer, n_head=2, n_embd=8,
                       tie_weights=tie)
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=generator)))
    model = GPT(config).double()
    idx = torch.randint(0, vocab, (dp * 2, 8), generator=generator)
    tgt = torch.randint(0, vocab, (dp * 2, 8), generator=generator)
    return model, idx, tgt


def _replica_gradients(model, idx, tgt, dp: int):
    """Each dp replica's float64 gradient of its own rows' mean loss, and that loss."""
    rows = idx.shape[0] // dp
    grads, losses = [], []
    for d in range(dp):
        model.zero_grad(set_to_none=True)
        _, loss = model(idx[d * rows:(d + 1) * rows], tgt[d * rows:(d + 1) * rows])
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        losses.append(float(loss.detach()))
    return grads, losses


def _parts(generator, total: torch.Tensor, n: int) -> list:
    """n random tensors that sum to `total`, each about its size (no large cancellation)."""
    if n == 1:
        return [total.clone()]
    scale = total.abs().mean().clamp(min=1e-3)
    noise = [torch.randn(total.shape, generator=generator, dtype=total.dtype) * scale
             for _ in range(n - 1)]
    return [total / n + e for e in noise] + [total / n - sum(noise)]


def make_finish_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    cases = []
    for title, (dp, tp, pp, sp, tie, dp_reduce, clip) in MESHES.get(world_size, []):
        n_layer = pp + int(torch.randint(0, 2, (), generator=generator))  # pp may not divide it
        vocab = 24 * int(torch.randint(1, 3, (), generator=generator))    # tp in (1, 2) divides it
        grads, losses = _replica_gradients(*_case_model(generator, dp, tie, n_layer, vocab), dp)
        mean = {n: sum(g[n] for g in grads) / dp for n in grads[0]}
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in mean.values()))
        max_norm = {None: None, "acts": 0.5 * norm, "idle": 10.0 * norm}[clip]
        names = list(grads[0])
        if tie:  # the head's use of the embedding, a second copy when it lives on another stage
            names.append("lm_head.weight")
        inputs = [None] * world_size
        # Each replica's tied gradient split into its two uses, the SP ones into tp parts.
        tied_uses = [_parts(generator, g["wte.weight"], 2) if tie and pp > 1 else None for g in grads]
        sp_parts = [{n: _parts(generator, g[n], tp) for n in grads[0]
                     if sp and tp > 1 and any(k in n for k in _SP_NAMES)} for g in grads]
        for rank in range(world_size):
            t, d, s = rank % tp, (rank // tp) % dp, rank // (tp * dp)
            held, layout = {}, {}
            for name in names:
                source = "wte.weight" if name == "lm_head.weight" and tie else name
                if s not in _stage_of(name, n_layer, pp):
                    continue
                if tie and pp == 1 and name == "lm_head.weight":
                    continue  # one stage: the embedding and the head are one tensor
                tied = tie and pp > 1 and source == "wte.weight"
                dim = _tp_dim(name)
                kind = "split" if dim is not None and tp > 1 else (
                    "partial" if name in sp_parts[d] else "replicated")
                if tied:
                    raw = tied_uses[d][0 if name == "wte.weight" else 1]
                elif kind == "partial":
                    raw = sp_parts[d][name][t]
                else:
                    raw = grads[d][source]
                if kind == "split":
                    raw = raw.tensor_split(tp, dim=dim)[t]
                held[name] = raw.float().contiguous()
                layout[name] = {"tp": kind, "tied": tied}
            inputs[rank] = {
                "dims": (dp, tp, pp), "tie": tie, "grads": held, "layout": layout,
                "loss": torch.tensor(losses[d], dtype=torch.float32) if s == pp - 1 else None,
                "dp_reduce": dp_reduce, "max_norm": max_norm}
        cases.append(Case(title, inputs))
    return cases


def expect_finish_step(inputs: list) -> list:
    """One process's answer, in float64, from every rank's raw gradients: each replica's
    gradient is its tp parts summed (sequence parallelism) and its tied copies summed; one
    process's is the mean of the replicas'; the norm counts every number of the model once.
    (tests/test_course_homework_parallel_step.py checks that this equals the GPT's own
    one-process gradient on the whole batch.)"""
    dp, tp, pp = inputs[0]["dims"]

    def at(s, d, t):
        return inputs[(s * dp + d) * tp + t]

    replica = []  # per rank: name -> this replica's whole-tp-slice gradient (float64)
    for rank, case in enumerate(inputs):
        t, d, s = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        own = {}
        for name, g in case["grads"].items():
            what = case["layout"][name]
            if what["tied"]:
                g = sum(at(e, d, t)["grads"][o].double() for e, o in
                        ((0, "wte.weight"), (pp - 1, "lm_head.weight")))
            elif what["tp"] == "partial":
                g = sum(at(s, d, u)["grads"][name].double() for u in range(tp))
            own[name] = g.double()
        replica.append(own)
    mean = [{n: sum(replica[(rank // (tp * dp) * dp + d) * tp + rank % tp][n] for d in range(dp)) / dp
             for n in own} for rank, own in enumerate(replica)]
    total = 0.0
    for rank, case in enumerate(inputs):
        t, d, s = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        for name, g in mean[rank].items():
            what = case["layout"][name]
            counted = d == 0 and (what["tp"] == "split" or t == 0) and (not what["tied"] or s == 0)
            total += float(g.pow(2).sum()) if counted else 0.0
    norm = math.sqrt(total)
    loss = sum(float(at(pp - 1, d, 0)["loss"]) for d in range(dp)) / dp
    out = []
    for rank, case in enumerate(inputs):
        if not case["dp_reduce"]:
            out.append({"grads": replica[rank], "loss": loss, "norm": None})
            continue
        m = case["max_norm"]
        coef = 1.0 if m is None else min(1.0, m / (norm + 1e-6))
        out.append({"grads": {n: g * coef for n, g in mean[rank].items()}, "loss": loss,
                    "norm": norm})
    return out


def _part_scales(inputs: list) -> dict:
    """name -> the largest |number| any rank holds of that gradient (a tied embedding's two
    copies together): the size of the parts a rank's sums add up."""
    scales = {}
    for case in inputs:
        for name, g in case["grads"].items():
            key = "wte.weight" if case["layout"][name]["tied"] else name
            scales[key] = max(scales.get(key, 0.0), float(g.abs().max()) if g.numel() else 0.0)
    return scales


def _gradient_tolerance(inputs: list, world_size: int) -> dict:
    """name -> the bound for that gradient: a sum over at most `world_size` parts in another
    order, at the scale of its largest part (parts that are all zero sum to zero exactly)."""
    return {key: gradient(world_size).at_scale(scale) if scale > 0 else exact()
            for key, scale in _part_scales(inputs).items()}


def _far(got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> bool:
    return not tol.close(got, want)


def _ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    norm = float(want.norm())
    return float(got.double().norm()) / norm if norm else float("nan")


def judge_finish_step(inputs, expected, outputs, world_size) -> str:
    dp, tp, pp = inputs[0]["dims"]
    tols = _gradient_tolerance(inputs, world_size)

    def tol(rank, name):
        return tols["wte.weight" if inputs[rank]["layout"][name]["tied"] else name]

    for rank, (out, want) in enumerate(zip(outputs, expected)):
        if out.get("error"):
            return f"rank {rank} {out['error']}"
        if not out["in_place"]:
            return (f"rank {rank}: a gradient tensor of `grads` was replaced; change the "
                    f"tensors in place (the optimizer holds them)")
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        if out["loss"] is None or not loss_tolerance().allows(out["loss"] - want["loss"], want["loss"]):
            got = "no number" if out["loss"] is None else f"{out['loss']:.6g}"
            ratio = "" if out["loss"] is None else f", ratio {out['loss'] / want['loss']:.4g}"
            return f"rank {rank}: loss {got}, one process's is {want['loss']:.6g}{ratio}"
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        coords = f"dp {(rank // tp) % dp}, tp {rank % tp}, pp {rank // (tp * dp)}"
        for name, w in want["grads"].items():
            g = out["grads"].get(name)
            if g is None or g.shape != w.shape:
                return f"rank {rank} ({coords}): {name} is not a tensor of shape {tuple(w.shape)}"
        far = [n for n, w in want["grads"].items() if _far(out["grads"][n], w, tol(rank, n))]
        if not far:
            continue
        ratios = [_ratio(out["grads"][n], want["grads"][n]) for n in want["grads"]]
        if want["norm"] is not None and max(ratios) - min(ratios) < 1e-4 * max(ratios):
            break  # every gradient scaled alike: the clip's coefficient; the norm says why
        name = far[0]
        what = inputs[rank]["layout"][name]
        kind = what["tp"] + (", tied" if what["tied"] else "")
        return (f"rank {rank} ({coords}): the gradient of {name} ({kind}) differs from one "
                f"process's (its norm is {_ratio(out['grads'][name], want['grads'][name]):.4g} "
                f"times one process's)")
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        if want["norm"] is None:
            if not out["norm_is_none"]:
                return f"rank {rank}: returned a norm although the optimizer averages dp (None)"
            continue
        if out["norm"] is None or not gradient(world_size).allows(out["norm"] - want["norm"],
                                                                 want["norm"]):
            got = "no number" if out["norm"] is None else f"{out['norm']:.6g}"
            ratio = "" if out["norm"] is None else f", ratio {out['norm'] / want['norm']:.4g}"
            return f"rank {rank}: norm {got}, one process's is {want['norm']:.6g}{ratio}"
        if any(_far(out["grads"][n], w, tol(rank, n)) for n, w in want["grads"].items()):
            ratio = _ratio(next(iter(out["grads"].values())), next(iter(want["grads"].values())))
            return (f"rank {rank}: the norm is right, but every gradient is {ratio:.4g} times "
                    f"one process's clipped gradient")
    return ""

FINISH_STEP = ExerciseSpec(
    id="finish_step", title="Finishing a composed step: one process's gradients, loss and norm",
    difficulty="★★★ hard", world_sizes=(4, 6, 8), make_cases=make_finish_cases,
    call=call_finish_step, expect=expect_finish_step, judge=judge_finish_step,
    reference=torch_finish_step,
    forbidden=tuple(c for c in COLLECTIVES if c not in ("all_reduce", "broadcast")),
    banned=("reference.course.homework.parallel_step_rank.course_finish_step",
            "reference.parallel.step", "reference.parallel.clip",
            "reference.tensor_parallel.plan.allreduce_sequence_parallel_grads"))
