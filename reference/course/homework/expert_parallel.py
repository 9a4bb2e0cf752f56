"""Hidden checks of homework 05: top-k routing with capacity, and all-to-all dispatch and combine.

Exercise `top_k_routing` (one process, all collectives off): the student routes the
(T, E) logits of one sequence and is compared with `reference.expert_parallel.router.Router`
itself, given an identity gate so that its logits are exactly the case's logits.
Cases: random tie-free logits (every two logits of a token at least 0.3 * scale apart, so
no float tie decides a choice), k = 1 (Switch: raw probability), 2 and 3, one token,
capacity large enough to keep everything, and logits skewed towards a few experts so that
first and second choices compete for the same slots. Indices and the keep mask must be
equal; weights within `reference.tolerance.forward()` (one softmax, sums in another order).

Exercise `dispatch_combine` (2 and 4 ranks, only `all_to_all_single` allowed; a bonus):
each rank holds its own tokens, their expert assignments (-1 = dropped at capacity) and
weights; the expert function the grader hands in records where it runs and on how
many rows. The result must equal the grader's single-process sum
``out[t] = sum_j w[t, j] * f(e[t, j], x[t])``, and, what the lecture's dispatch did not
do, it must be differentiable: after ``out.backward(grad_out)`` on every rank, the
gradients of this rank's tokens and weights must equal the single-process ones (the
backward of an all-to-all is the all-to-all with the splits swapped). Every expert
must run only on the rank that holds it, on exactly the rows that chose it; no
point-to-point message, and no more all-to-all traffic than the rows need, forward and
backward. Values and gradients within `reference.tolerance.forward()` of the float64
reference plus `expert_traffic.rounding_bounds` (float32's rounding of sin's argument
x (e + 1)). The lecture's forward-only dispatch loses every case. Cases: uneven token
counts per rank, every token to one expert (empty splits), dropped assignments and a
token that lost all of them, a rank with no tokens, k = 3.

The course's own answers (`reference_routing` and the router; `expert_dedup`'s
`course_dispatch_combine` and the layer, its all-to-all and its plan) are refused to the
student's code. The other exercises live in `expert_dedup` (the deduplicated dispatch and
the written question on its bytes), `expert_balance` (the balance loss of the global
batch) and `expert_bias` (DeepSeek-V3's bias moved by a whole step's load); the experts and the all-to-all the dispatch checks share, in `expert_traffic`.
"""
from __future__ import annotations

import torch

from reference.course.homework.expert_traffic import (  # noqa: F401 (re-exported for the checks)
    TOLERANCE, all_to_all_single_allowed, assignments, close, expert_fn_value, plain, rounding_bounds,
    call_dispatch_combine, call_dispatch_combine_backward,
)
from reference.course.homework.guard import COLLECTIVES
from reference.course.homework.scoring import WARM_UP, Case, ExerciseSpec
from reference.course.homework.subgroup import on_subgroup
from reference.expert_parallel.router import Router

__all__ = ["TOP_K_ROUTING", "DISPATCH_COMBINE", "EXERCISES", "reference_routing", "expert_fn_value",
           "make_routing_cases", "make_dispatch_cases", "all_to_all_single_allowed"]

# ------------------------------------------------------------------ exercise 1: routing


def tie_free_logits(generator, T: int, E: int, scale: float) -> torch.Tensor:
    """(T, E) logits whose values in a row are a shuffled 0..E-1 plus noise in [0, 0.7):
    random order, yet any two at least 0.3 * scale apart, so top-k never meets a tie."""
    ranks = torch.stack([torch.randperm(E, generator=generator) for _ in range(T)]).float()
    return (ranks + 0.7 * torch.rand(T, E, generator=generator)) * scale  # (T, E)


# (name, T, E, k, capacity, experts pushed to the top of every token's choices, or None)
ROUTING_SHAPES = (
    ("T=8 E=4 k=2 capacity=4", 8, 4, 2, 4, None),
    ("T=12 E=4 k=2 capacity=3, experts 0 and 1 favoured", 12, 4, 2, 3, (0, 1)),
    ("T=7 E=5 k=1 capacity=2 (Switch)", 7, 5, 1, 2, None),
    ("T=9 E=6 k=3 capacity=4", 9, 6, 3, 4, None),
    ("T=1 E=3 k=2 capacity=1", 1, 3, 2, 1, None),
    ("T=10 E=4 k=2 capacity=10 (no drop)", 10, 4, 2, 10, None),
    ("T=16 E=8 k=2 capacity=2, expert 3 favoured", 16, 8, 2, 2, (3,)),
)


def make_routing_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    cases = []
    for name, T, E, k, capacity, favourites in ROUTING_SHAPES:
        scale = 0.3 + 1.2 * float(torch.rand((), generator=generator))
        logits = tie_free_logits(generator, T, E, scale)
        for rank, expert in enumerate(favourites or ()):
            # Shifted above every other logit by at least 0.3 * scale: still tie-free.
            # The second half of the tokens ranks the favourites the other way round, so
            # one token's second choice competes with another's first for the same slots.
            logits[: T // 2, expert] += (len(favourites) - rank) * E * scale
            logits[T // 2:, expert] += (rank + 1) * E * scale
        cases.append(Case(name, [{"logits": logits, "k": k, "capacity": capacity}] * world_size))
    return cases


def reference_routing(logits: torch.Tensor, k: int, capacity: int) -> dict:
    """The course's router on these logits: an identity gate makes its logits exactly these."""
    T, E = logits.shape
    # capacity_factor chosen so that ceil(factor * T * k / E) is `capacity` again.
    router = Router(E, E, k, capacity_factor=capacity * E / (T * k))
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(E))
        routing = router(logits.unsqueeze(0))  # one group (1, T, E)
    assert routing.capacity == min(capacity, T), (routing.capacity, capacity)
    return {"expert_idx": routing.expert_idx[0], "weights": routing.weights[0],
            "kept": routing.kept[0]}


def call_routing(fn, case: dict) -> dict:
    out = fn(case["logits"].clone(), case["k"], case["capacity"])
    parts = list(out) if isinstance(out, (tuple, list)) else []
    return {"returned_type": type(out).__name__, "parts": [plain(p) for p in parts],
            "part_types": [type(p).__name__ for p in parts]}


def expect_routing(inputs: list) -> list:
    return [reference_routing(c["logits"], c["k"], c["capacity"]) for c in inputs]


def _check_part(got, want: torch.Tensor, name: str, kind: str) -> str:
    if got is None:
        return f"{name} is not a tensor"
    if got.shape != want.shape or got.dtype != want.dtype:
        return (f"{name} is {got.dtype} {tuple(got.shape)}; expected {want.dtype} "
                f"{tuple(want.shape)} ({kind})")
    return ""


def judge_routing(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    case, want, out = inputs[0], expected[0], outputs[0]
    if len(out["parts"]) != 3:
        return (f"returned {out['returned_type']} of {len(out['parts'])} items; expected the "
                f"tuple (expert_idx, weights, kept)")
    got = dict(zip(("expert_idx", "weights", "kept"), out["parts"]))
    kinds = {"expert_idx": "int64 (T, k)", "weights": "float32 (T, k)", "kept": "bool (T, k)"}
    for name in got:
        if why := _check_part(got[name], want[name], name, kinds[name]):
            return why
    k, capacity = case["k"], case["capacity"]
    if not torch.equal(got["expert_idx"], want["expert_idx"]):
        t = int((got["expert_idx"] != want["expert_idx"]).any(dim=1).nonzero()[0])
        return (f"token {t}: experts {got['expert_idx'][t].tolist()}, expected "
                f"{want['expert_idx'][t].tolist()} (the {k} most probable, most probable first)")
    bad = ~torch.isclose(got["weights"], want["weights"], **TOLERANCE)
    if bad.any():
        if not bad[want["kept"]].any():
            return ("weights of dropped assignments changed: return the router's weights "
                    "before capacity (`kept` alone says what was dropped)")
        t = int(bad.any(dim=1).nonzero()[0])
        rule = ("k = 1 keeps the raw softmax probability (Switch)" if k == 1 else
                "the chosen softmax probabilities renormalised to sum to 1 (GShard)")
        return (f"token {t}: weights {[round(w, 4) for w in got['weights'][t].tolist()]}, expected "
                f"{[round(w, 4) for w in want['weights'][t].tolist()]} ({rule})")
    if not torch.equal(got["kept"], want["kept"]):
        per_expert = torch.bincount(got["expert_idx"][got["kept"]], minlength=case["logits"].shape[1])
        if int(per_expert.max()) > capacity:
            e = int(per_expert.argmax())
            return f"expert {e} keeps {int(per_expert[e])} assignments; its capacity is {capacity}"
        t, j = (got["kept"] != want["kept"]).nonzero()[0].tolist()
        return (f"token {t}, choice {j}: kept={bool(got['kept'][t, j])}, expected "
                f"{bool(want['kept'][t, j])} (slots go to every first choice in position "
                f"order, then every second choice, ...)")
    return ""


def reference_routing_call(case: dict) -> dict:
    return reference_routing(case["logits"], case["k"], case["capacity"])


# ------------------------------------------------------------------ exercise 2: dispatch and combine


def make_dispatch_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    P = world_size

    def rank_input(n, C, epr, k, drop=0.0, everyone_to=None, drop_first=False):
        tokens = torch.randn(n, C, generator=generator)
        expert_idx = assignments(generator, n, epr * P, k)
        if everyone_to is not None:
            expert_idx[:, 0] = everyone_to
        if drop:
            expert_idx[torch.rand(n, k, generator=generator) < drop] = -1
        if drop_first and n:
            expert_idx[0] = -1  # this token lost all its assignments: its output is 0
        weights = torch.rand(n, k, generator=generator) * 0.9 + 0.1  # (n, k)
        if k > 1:  # GShard's renormalised weights; k = 1 keeps a raw probability below 1 (Switch)
            weights = weights / weights.sum(dim=1, keepdim=True)
        return {"tokens": tokens, "expert_idx": expert_idx, "weights": weights,
                "experts_per_rank": epr, "grad_out": torch.randn(n, C, generator=generator)}

    def sizes(low, high):
        return [int(torch.randint(low, high + 1, (), generator=generator)) for _ in range(P)]

    return [
        Case("k=2, 2 experts per rank, uneven tokens per rank",
             [rank_input(n, 4, 2, 2) for n in sizes(2, 7)]),
        Case("k=1, every token to expert 0 (empty splits)",
             [rank_input(n, 3, 1, 1, everyone_to=0) for n in sizes(1, 5)]),
        Case("k=2, dropped assignments (-1), a token dropped entirely",
             [rank_input(n, 4, 2, 2, drop=0.3, drop_first=(r == 0))
              for r, n in enumerate(sizes(3, 6))]),
        Case("k=2, the last rank has no tokens",
             [rank_input(0 if r == P - 1 else n, 2, 1, 2) for r, n in enumerate(sizes(2, 5))]),
        Case("k=3, 3 experts per rank",
             [rank_input(n, 3, 3, 3) for n in sizes(1, 6)]),
    ]


def _combined(x, idx, w):
    """Every token's weighted sum over its kept experts, (N, C), differentiable."""
    out = torch.zeros_like(x)  # (N, C)
    for j in range(idx.shape[1]):
        for e in idx[:, j].unique().tolist():
            if e >= 0:
                rows = idx[:, j] == e
                out = out.index_put((rows,), out[rows] + w[rows, j, None] * expert_fn_value(e, x[rows]))
    return out


def expect_dispatch_combine(inputs: list) -> list:
    """The single-process answer: every token's weighted sum over its kept experts (float64)."""
    return [_combined(c["tokens"].double(), c["expert_idx"], c["weights"].double()).float()
            for c in inputs]


def expect_dispatch_combine_backward(inputs: list) -> list:
    """The single-process answer and, from each rank's grad_out, the gradients of its tokens
    and weights (float64, returned as float32)."""
    results = []
    for case in inputs:
        x = case["tokens"].double().requires_grad_()
        w = case["weights"].double().requires_grad_()
        out = _combined(x, case["expert_idx"], w)
        if out.requires_grad:  # not when no assignment is kept (a rank without tokens)
            out.backward(case["grad_out"].double())
        results.append({"out": out.detach().float(),
                        "grad_tokens": (torch.zeros_like(case["tokens"]) if x.grad is None
                                        else x.grad.float()),
                        "grad_weights": (torch.zeros_like(case["weights"]) if w.grad is None
                                         else w.grad.float())})
    return results


def judge_dispatch_combine(inputs: list, expected: list, outputs: list, world_size: int) -> str:
    epr, C = inputs[0]["experts_per_rank"], inputs[0]["tokens"].shape[1]
    E = epr * world_size
    chosen = torch.bincount(torch.cat([c["expert_idx"].reshape(-1) for c in inputs]) + 1,
                            minlength=E + 1)[1:]  # (E,) kept assignments per expert, all ranks
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        got = out["returned"]
        if got is None:
            return f"rank {rank} returned {out['returned_type']}, not a tensor"
        if got.shape != want.shape or got.dtype != want.dtype:
            return (f"rank {rank} returned {got.dtype} {tuple(got.shape)}; expected {want.dtype} "
                    f"{tuple(want.shape)} (one row per token of this rank)")
        for e, n in out["ran"]:
            if not rank * epr <= e < (rank + 1) * epr:
                return (f"expert {e} ran on rank {rank}, but it lives on rank {e // epr}: send "
                        f"its rows there")
        if out.get("sends") or out.get("recvs"):
            return f"rank {rank} used point-to-point messages: send the rows with all_to_all_single"
    ran = torch.zeros(E, dtype=torch.long)
    for out in outputs:
        for e, n in out["ran"]:
            if 0 <= e < E:
                ran[e] += n
    if not torch.equal(ran, chosen):
        e = int((ran != chosen).nonzero()[0])
        return (f"expert {e} processed {int(ran[e])} rows; {int(chosen[e])} kept assignments "
                f"chose it (each assignment's row once, dropped ones never)")
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        got = out["returned"]
        bad = ~close(got, want, rounding_bounds(inputs[rank])["out"]).all(dim=1)
        if bad.any():
            t = int(bad.nonzero()[0])
            return (f"rank {rank}, token {t}: wrong output (max abs error "
                    f"{(got[t] - want[t]).abs().max().item():.3g}); each token's row must come "
                    f"back to its own position, as the weighted sum of its experts' outputs")
        # Rows out (dispatch) plus rows back (combine), with room for counts, ids and positions.
        n_out = int((inputs[rank]["expert_idx"] >= 0).sum())
        n_in = int(chosen[rank * epr:(rank + 1) * epr].sum())
        limit = (n_out + n_in) * (C + 2) + 4 * (E + world_size)
        sent = sum(s for s, _ in out["all_to_all"])
        if sent > limit:
            return (f"rank {rank} sent {sent} elements through all_to_all_single; its rows need "
                    f"about {(n_out + n_in) * C} (send each row only to its expert's rank)")
    return ""


def judge_dispatch_combine_backward(inputs: list, expected: list, outputs: list,
                                    world_size: int) -> str:
    """The forward's checks (values, where experts ran, traffic for both directions), then
    the gradients of every rank's tokens and weights."""
    values = [e["out"] for e in expected]
    forward = [dict(o, all_to_all=o["all_to_all"][:o["forward_calls"]]) for o in outputs]
    if why := judge_dispatch_combine(inputs, values, forward, world_size):
        return why
    for rank, out in enumerate(outputs):
        sent_forward = sum(s for s, _ in out["all_to_all"][:out["forward_calls"]])
        sent_backward = sum(s for s, _ in out["all_to_all"][out["forward_calls"]:])
        if sent_backward > sent_forward:
            return (f"rank {rank} sent {sent_backward} elements in backward, more than the "
                    f"{sent_forward} of the forward: the gradients retrace the rows' way")
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        for name, what in (("grad_tokens", "tokens"), ("grad_weights", "weights")):
            got, w = out[name], want[name]
            if got is None:
                return (f"rank {rank}: no gradient reached the {what} (is the dispatch "
                        f"differentiable? all_to_all_single itself is not)")
            if got.shape != w.shape:
                return f"rank {rank}: the gradient of the {what} has shape {tuple(got.shape)}"
            if not close(got, w, rounding_bounds(inputs[rank])[name]).all():
                return (f"rank {rank}: wrong gradient of the {what} (max abs error "
                        f"{(got - w).abs().max().item():.3g})")
    return ""


def reference_dispatch_combine(case: dict) -> torch.Tensor:
    return expect_dispatch_combine([case])[0]


TOP_K_ROUTING = ExerciseSpec(
    id="top_k_routing", title="top-k routing with capacity", difficulty="★☆☆ warm-up",
    weight=WARM_UP,
    world_sizes=(1,), make_cases=make_routing_cases, call=call_routing,
    expect=expect_routing, judge=judge_routing, reference=reference_routing_call,
    banned=("reference.course.homework.expert_parallel.reference_routing",
            "reference.expert_parallel.router"))
DISPATCH_COMBINE = on_subgroup(ExerciseSpec(
    id="dispatch_combine", title="dispatch and combine with all-to-all", difficulty="★★★ hard",
    bonus=True,
    world_sizes=(2, 4), make_cases=make_dispatch_cases, call=call_dispatch_combine_backward,
    expect=expect_dispatch_combine_backward, judge=judge_dispatch_combine_backward,
    reference=reference_dispatch_combine,
    forbidden=tuple(c for c in COLLECTIVES if c != "all_to_all_single"),
    banned=("reference.course.homework.expert_dedup.course_dispatch_combine",
            "reference.expert_parallel.comms", "reference.comms.functional.all_to_all",
            "reference.expert_parallel.moe",
            "reference.expert_parallel.router.sort_by_expert",
            "reference.expert_parallel.router.combine")), (4,), (0, 3))
HOMEWORK_ID = "05_expert_parallel"
# The warm-up (routing), the lecture's dispatch written by hand, two transfers to what the
# lecture did not build (deduplicated dispatch; the balance loss over the global batch),
# the written question, and a third transfer (the bias balancing of the lecture's last
# run, moved by a whole step's load over micro-batches and ranks).
from reference.course.homework.expert_balance import GLOBAL_BALANCE_LOSS  # noqa: E402
from reference.course.homework.expert_bias import BALANCED_STEP  # noqa: E402
from reference.course.homework.expert_dedup import (  # noqa: E402 - after the specs they extend
    DEDUP_ALL_TO_ALL_BYTES, DISPATCH_COMBINE_DEDUP,
)

# An answer failing any case keeps at most half: a rule broken alone shows only in the
# cases that can show it.
WRONG_KEEPS = 0.5
EXERCISES = (TOP_K_ROUTING, DISPATCH_COMBINE, DISPATCH_COMBINE_DEDUP, GLOBAL_BALANCE_LOSS,
             DEDUP_ALL_TO_ALL_BYTES, BALANCED_STEP)
