"""Hidden checks of homework 06's recompute exercise: activation checkpointing by hand, the
dropout masks drawn again exactly as the forward drew them.

``recompute(fn, x)`` must return ``fn(x)`` without keeping fn's intermediate activations:
it keeps the input and the random state, and in backward restores that state, runs ``fn``
again under grad and backpropagates through it, so that the gradients of ``x`` and of the
weights ``fn`` closes over are those of running ``fn`` directly. ``fn`` is a function of one
tensor (a GPT block, ``lambda t: block(t)[0]``, or an MLP of weight tensors) that draws its
dropout masks from the default CPU generator; ``x`` requires grad. It is notebook 06's
seventh clinic mistake turned into an exercise: a recomputation that draws other masks
computes the gradient of another network than the one whose output was sent on.

One process runs every case (world size 1; every collective is refused). The grader seeds
the generator, calls ``recompute`` (several times in a row for a stack of blocks), then
backpropagates ``(y * grad_out).sum()``; the expected answer is the same run with ``fn``
called directly (`expect_recompute`, in the grader's process). The judge, in this order:

* the output equals the direct run's (within `reference.tolerance.forward()`, as every
  comparison here: the same float32 computation, run in another process, whose kernels
  may add in another order); in a row, each block draws its masks where the one before
  left the generator;
* the tensors autograd saved while ``recompute`` ran (``saved_tensors_hooks``; distinct
  storages, fn's weights not counted) total at most each call's input and one random
  state (`RNG_BYTES`): a forward that keeps fn's activations keeps several times more;
* ``fn`` ran exactly once more during backward (the recomputation);
* the gradients of ``x`` and of every weight equal the direct run's;
* in the case of the caller's draws: ``torch.rand`` drawn by the caller after the forward
  and after the backward equals the direct run's: the generator ends where one run of
  ``fn`` leaves it, whatever the recomputation drew. (How often the forward runs ``fn`` is
  not judged, only its effects: a second run leaves the caller's generator advanced twice.)

Cases: a GPT block without dropout, one with dropout 0.1, an MLP of weight tensors with
dropout 0.5, two blocks in a row each recomputed (dropout 0.2: a random state kept per call,
not one for all), and the caller's draws around an MLP with dropout 0.3. Recomputing
without restoring the random state loses every case with dropout; keeping the
activations (returning ``fn(x)``) loses every case; leaving the generator elsewhere than
one run of ``fn`` leaves it loses the caller's case, and when the forward leaves it so
(advanced twice, or not at all), the two blocks in a row too. `torch.utils.checkpoint` and
`reference.tensor_parallel.rng.RNGStates` refuse to run from the student's code
(`refuse`), as the course's own answer does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from reference.course.homework.scoring import Case, ExerciseSpec
from reference.model import Block, GPTConfig
from reference.tolerance import forward

__all__ = ["RECOMPUTE", "make_recompute_cases", "expect_recompute", "judge_recompute",
           "call_recompute", "course_recompute", "torch_recompute", "RNG_BYTES"]

RNG_BYTES = torch.get_rng_state().nbytes  # the default CPU generator's state: 5,056 bytes
DRAWS = 16  # numbers the caller draws after the forward and after the backward
TOLERANCE = forward()
# (title, kind, dropout, functions in a row, the caller draws around it). Without dropout
# first: the visible check stops at the first failure, and a recomputation that is wrong
# only with dropout shows as such.
PLAN = (("a GPT block without dropout", "block", 0.0, 1, False),
        ("a GPT block, dropout 0.1", "block", 0.1, 1, False),
        ("an MLP of weight tensors, dropout 0.5", "mlp", 0.5, 1, False),
        ("two GPT blocks in a row, each recomputed, dropout 0.2", "block", 0.2, 2, False),
        ("the caller's random draws around an MLP, dropout 0.3", "mlp", 0.3, 1, True))


def make_recompute_cases(generator: torch.Generator, world_size: int) -> list[Case]:
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=generator))

    cases = []
    for title, kind, p, chain, draws in PLAN:
        B, T, C = draw(2, 4), draw(8, 16), 16 * draw(1, 2)
        config = dict(vocab_size=8, block_size=T, n_layer=2, n_head=2, n_embd=C, dropout=p)
        weights = []
        for _ in range(chain):
            if kind == "block":  # torch's own initialisation, from a seed of the generator
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(draw(0, 2**31 - 1))
                    block = Block(GPTConfig(**config))
                    for t in block.parameters():  # LayerNorms not at 1 and 0 either
                        t.data += 0.1 * torch.randn(t.shape, generator=generator)
                weights.append({n: t.detach().clone() for n, t in block.named_parameters()})
            else:
                H = 4 * C
                weights.append({"w1": torch.randn(C, H, generator=generator) / C ** 0.5,
                                "b1": 0.1 * torch.randn(H, generator=generator),
                                "w2": torch.randn(H, C, generator=generator) / H ** 0.5,
                                "b2": 0.1 * torch.randn(C, generator=generator)})
        shape = (B, T, C) if kind == "block" else (2 * B * T, C)  # rows of tokens
        case = {"kind": kind, "p": p, "config": config, "weights": weights, "draws": draws,
                "seed": draw(0, 2**31 - 1), "x": torch.randn(shape, generator=generator),
                "grad_out": torch.randn(shape, generator=generator)}
        cases.append(Case(title, [case] * world_size))
    return cases


def _build(case: dict):
    """The case's functions, each of one tensor, and their weights (name -> leaf tensor)."""
    fns, leaves = [], {}
    for i, weights in enumerate(case["weights"]):
        prefix = f"block {i} " if len(case["weights"]) > 1 else ""
        if case["kind"] == "block":
            block = Block(GPTConfig(**case["config"]))
            block.load_state_dict(weights)
            block.train()  # dropout on
            fns.append(lambda t, block=block: block(t)[0])  # a block returns (x, aux_loss)
            leaves.update((prefix + n, t) for n, t in block.named_parameters())
        else:
            w = {n: t.clone().requires_grad_(True) for n, t in weights.items()}
            p = case["p"]
            fns.append(lambda t, w=w: F.dropout(F.gelu(t @ w["w1"] + w["b1"]), p, training=True)
                       @ w["w2"] + w["b2"])
            leaves.update((prefix + n, t) for n, t in w.items())
    return fns, leaves


def call_recompute(fn, case: dict) -> dict:
    fns, leaves = _build(case)
    runs = {"forward": [0] * len(fns), "backward": [0] * len(fns)}
    phase = ["forward"]

    def counted(i):
        def run(t):
            runs[phase[0]][i] += 1
            return fns[i](t)
        return run

    weights = {t.untyped_storage().data_ptr() for t in leaves.values()}
    saved = []  # every tensor autograd saved while the student's function ran (kept alive:
                # a freed storage's address could come back and hide another)

    def pack(t):
        saved.append(t)
        return t

    torch.manual_seed(case["seed"])
    x = case["x"].clone().requires_grad_(True)
    y = x
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for i in range(len(fns)):
            y = fn(counted(i), y)
            if not isinstance(y, torch.Tensor):
                return {"error": f"returned {type(y).__name__}, not a tensor"}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in weights}
    saved.clear()
    if y.shape != x.shape:
        return {"error": f"returned a tensor of shape {tuple(y.shape)}, fn's is {tuple(x.shape)}"}
    if not y.requires_grad:
        return {"error": "the output does not require grad: backward cannot reach x or fn's weights"}
    phase[0] = "backward"
    after_forward = torch.rand(DRAWS) if case["draws"] else None
    (y * case["grad_out"]).sum().backward()
    after_backward = torch.rand(DRAWS) if case["draws"] else None
    return {"error": "", "out": y.detach().clone(), "runs": runs, "saved_bytes": sum(storages.values()),
            "x_grad": None if x.grad is None else x.grad.detach().clone(),
            "grads": {n: None if t.grad is None else t.grad.detach().clone() for n, t in leaves.items()},
            "draws": None if after_forward is None else [after_forward, after_backward]}


def expect_recompute(inputs: list) -> list:
    """The same run with fn called directly (the grader's own generator left untouched)."""
    case = inputs[0]
    with torch.random.fork_rng(devices=[]):
        fns, leaves = _build(case)
        torch.manual_seed(case["seed"])
        x = case["x"].clone().requires_grad_(True)
        y = x
        for f in fns:
            y = f(y)
        after_forward = torch.rand(DRAWS)
        (y * case["grad_out"]).sum().backward()
        after_backward = torch.rand(DRAWS)
    return [{"out": y.detach(), "x_grad": x.grad, "grads": {n: t.grad for n, t in leaves.items()},
             "draws": [after_forward, after_backward]}] * len(inputs)


def _gap(got, want: torch.Tensor) -> float | None:
    """The largest difference beyond the tolerance's, None when within it."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return float("inf")
    if TOLERANCE.close(got, want):
        return None
    return float((got.double() - want.double()).abs().max())


def judge_recompute(inputs, expected, outputs, world_size) -> str:
    case, out, want = inputs[0], outputs[0], expected[0]
    if out.get("error"):
        return out["error"]
    chain = len(case["weights"])
    which = ["fn"] if chain == 1 else [f"the function of block {i}" for i in range(chain)]
    if (gap := _gap(out["out"], want["out"])) is not None:
        what = "fn(x)" if chain == 1 else f"the {chain} blocks"
        return f"the output differs from {what} run directly with the same seed by up to {gap:.2g}"
    allowed = chain * (case["x"].nbytes + RNG_BYTES)
    if out["saved_bytes"] > allowed:
        return (f"the forward kept {out['saved_bytes']:,} bytes of tensors for backward, more than "
                f"the input and one random state per call ({allowed:,} bytes)")
    for name, n in zip(which, out["runs"]["backward"]):
        if n != 1:
            return f"{name} ran {n} times during backward (a recomputation runs it once)"
    drop = f"dropout {case['p']:g}" if case["p"] else "no dropout"
    grads = [("x", out["x_grad"], want["x_grad"])] + [
        (n, out["grads"].get(n), w) for n, w in want["grads"].items()]
    for name, got, w in grads:
        if got is None:
            return f"{name} has no gradient after backward ({drop})"
        if (gap := _gap(got, w)) is not None:
            return (f"the gradient of {name} differs from a run without checkpointing by up to "
                    f"{gap:.2g} ({drop})")
    if case["draws"]:
        for when, got, w in zip(("forward", "backward"), out["draws"], want["draws"]):
            if not torch.equal(got, w):
                return (f"the caller's random draws after the {when} differ from a run without "
                        f"checkpointing")
    return ""


class _Recompute(torch.autograd.Function):
    """The course's answer: keep the input and the random state; replay both in backward."""

    @staticmethod
    def forward(ctx, function, block_input):
        ctx.function, ctx.rng_state = function, torch.get_rng_state()
        ctx.save_for_backward(block_input)
        with torch.no_grad():  # no graph: fn's activations are freed as it goes
            return function(block_input)

    @staticmethod
    def backward(ctx, grad_output):
        (kept,) = ctx.saved_tensors
        again = kept.detach().requires_grad_(kept.requires_grad)
        with torch.random.fork_rng(devices=[]):  # the caller's stream goes on untouched
            torch.set_rng_state(ctx.rng_state)   # the forward's masks, drawn again
            with torch.enable_grad():
                output = ctx.function(again)
        torch.autograd.backward(output, grad_output)
        return None, again.grad


def course_recompute(fn, x):
    return _Recompute.apply(fn, x)


def torch_recompute(case: dict) -> dict:
    """torch's own activation checkpointing, through the same call (a reference for tests)."""
    from torch.utils.checkpoint import checkpoint

    return call_recompute(lambda f, t: checkpoint(f, t, use_reentrant=False), case)


RECOMPUTE = ExerciseSpec(
    id="recompute", title="Activation checkpointing by hand: the same dropout masks again",
    difficulty="★★☆ medium", world_sizes=(1,), make_cases=make_recompute_cases,
    call=call_recompute, expect=expect_recompute, judge=judge_recompute,
    reference=torch_recompute,
    banned=("reference.course.homework.parallel_recompute.course_recompute",
            "reference.course.homework.parallel_recompute._Recompute",
            "torch.utils.checkpoint", "reference.tensor_parallel.rng.RNGStates"))
