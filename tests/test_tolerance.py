"""The tolerance policy (`reference.tolerance`): each bound holds where its docstring says it
holds, is reached where it says a run can reach it, and still catches a wrong run; and no
notebook asserts a literal tolerance of its own."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.tolerance import (UNIT_ROUNDOFF, Tolerance, adamw_ratio_bound, adamw_weights, exact,
                                 expert_bias, forward, gradient, loss, sgd_weights)

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the Tolerance object
def test_a_tolerance_unpacks_as_keyword_arguments_and_names_its_reason():
    tol = forward()
    assert dict(**tol) == {"rtol": 1e-5, "atol": 1e-6}
    x = torch.ones(3)
    torch.testing.assert_close(x, x + 5e-6, **tol)           # within 1e-6 + 1e-5 * 1
    with pytest.raises(AssertionError, match=r"wte: largest difference .* \(fp32, the same sums"):
        tol.assert_close(x, x + 1e-4, "wte")
    with pytest.raises(AssertionError, match="shape"):
        tol.assert_close(torch.ones(3), torch.ones(4), "wte")
    assert not tol.close(torch.tensor([float("nan")]), torch.tensor([0.0]))


def test_exact_is_bit_for_bit():
    x = torch.randn(100)
    exact().assert_close(x.clone(), x)
    nudged = torch.nextafter(x, torch.full_like(x, float("inf")))
    with pytest.raises(AssertionError):
        exact().assert_close(nudged, x)


def test_at_scale_grows_the_atol_only():
    tol = forward().at_scale(100)
    assert (tol.rtol, tol.atol) == (1e-5, pytest.approx(1e-4))
    with pytest.raises(ValueError):
        forward().at_scale(0)


def test_bad_arguments_are_refused_with_a_reason():
    for call in (lambda: gradient(0), lambda: adamw_weights(0, 1e-3), lambda: adamw_weights(3, 0.0),
                 lambda: sgd_weights(1, -1.0), lambda: adamw_ratio_bound(0), lambda: forward(torch.int32)):
        with pytest.raises(ValueError):
            call()


# ---------------------------------------------------------------- section 1: reordered sums
@pytest.mark.parametrize("n", [2, 8, 64, 4096])
def test_a_sum_added_in_another_order_stays_within_the_gradient_bound(n):
    """n partial gradients, each of order 1/n (a mean over n ranks or micro-batches, as the
    course's gradients are), summed one way and in a random other order; the worst of many
    trials is within `gradient(n)`. Terms of order 1 (a sum of magnitude up to n) take
    `at_scale(n)`."""
    g = torch.Generator().manual_seed(n)
    for _ in range(20):
        terms = torch.randn(n, 64, generator=g)
        order = torch.randperm(n, generator=g)
        for scale, tol in ((1.0 / n, gradient(n)), (1.0, gradient(n).at_scale(n))):
            one = (terms * scale).sum(0)
            other = torch.zeros(64)
            for i in order:
                other += terms[i] * scale
            tol.assert_close(other, one, f"{n} terms of order {scale:g}")


def test_gradient_grows_with_the_number_of_partial_sums():
    assert gradient(1).summary() == forward().summary()
    assert gradient(8).rtol == pytest.approx(1e-5 + 14 * UNIT_ROUNDOFF[torch.float32])


def test_half_precision_bounds_are_a_few_roundings_of_the_format():
    for dtype in (torch.bfloat16, torch.float16):
        tol = forward(dtype)
        assert 2 * UNIT_ROUNDOFF[dtype] <= tol.rtol <= 3 * UNIT_ROUNDOFF[dtype]
        x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
        tol.assert_close(x.to(dtype).float(), x, f"{dtype}: one rounding")   # one rounding passes
        assert loss(dtype).rtol == 1e-3


# ---------------------------------------------------------------- section 3: AdamW
def _adamw_run(grads, lr=1e-3, weight_decay=0.0):
    w = torch.nn.Parameter(torch.zeros(len(grads[0])))
    opt = torch.optim.AdamW([w], lr=lr, weight_decay=weight_decay)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach()


def test_adamw_ratio_bound_is_reached_and_never_passed():
    """The Cauchy-Schwarz bound: the gradients proportional to a_i / b_i reach it; random ones
    stay under it."""
    b1, b2 = 0.9, 0.999
    for k in (1, 2, 3, 5):
        a = [(1 - b1) * b1 ** (k - i) / (1 - b1 ** k) for i in range(1, k + 1)]
        b = [(1 - b2) * b2 ** (k - i) / (1 - b2 ** k) for i in range(1, k + 1)]
        m = sum(ai * ai / bi for ai, bi in zip(a, b))
        v = sum(bi * (ai / bi) ** 2 for ai, bi in zip(a, b))
        assert m / v ** 0.5 == pytest.approx(adamw_ratio_bound(k), rel=1e-12)
        worst = torch.randn(2000, k, generator=torch.Generator().manual_seed(k)).abs()
        weights = torch.tensor(a, dtype=torch.float64)
        ratio = (worst.double() @ weights) / ((worst.double() ** 2) @ torch.tensor(b, dtype=torch.float64)).sqrt()
        assert ratio.max().item() <= adamw_ratio_bound(k) * (1 + 1e-12)
    assert adamw_ratio_bound(1) == 1.0 and adamw_ratio_bound(3) == pytest.approx(1.0036, abs=1e-4)


def test_a_last_bit_gradient_difference_can_take_the_whole_adamw_step_but_not_more():
    """Two runs whose gradients differ only in the last bits of a near-zero coordinate (its
    terms cancelled): AdamW moves that weight by nearly the bound, apart, and never beyond."""
    steps, lr = 3, 1e-3
    tol = adamw_weights(steps, lr)
    tiny = 1e-6                                   # far above eps = 1e-8: the ratio is +-1
    g_one = [torch.tensor([tiny, 0.5]) for _ in range(steps)]
    g_par = [torch.tensor([-tiny, 0.5]) for _ in range(steps)]    # a cancelled sum's sign flipped
    diff = (_adamw_run(g_one, lr) - _adamw_run(g_par, lr)).abs()
    assert diff[0] > 0.98 * (tol.atol - forward().atol)           # the bound is reached
    assert diff[0] <= tol.atol and diff[1] == 0
    # weight decay never makes a difference grow
    diff_wd = (_adamw_run(g_one, lr, 0.1) - _adamw_run(g_par, lr, 0.1)).abs()
    assert diff_wd[0] <= diff[0]


def _tiny_gpt_grads():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=2))
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (4, 17), generator=g)
    chunks = []
    for i in range(2):                           # two "data-parallel ranks" of 2 sequences
        model.zero_grad()
        _, l = model(data[2 * i:2 * i + 2, :-1], data[2 * i:2 * i + 2, 1:])
        l.backward()
        chunks.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return model, chunks


def _train(model, grads_per_step, clip=None):
    model = GPT(GPTConfig.tiny(n_layer=2))
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = dict(model.named_parameters())
    for grads in grads_per_step:
        for n, p in params.items():
            p.grad = grads[n].clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


def test_the_mean_checks_pass_a_reordered_run_and_catch_wrong_reductions():
    """One process's gradient is the mean over the two chunks. Added in the other order (what a
    data-parallel all-reduce does) the weights after 3 AdamW steps pass. Wrong reductions fail
    on a mean even though every single weight stays within AdamW's step: no all-reduce at all;
    the LayerNorms' gradients from one rank only (sequence parallelism's sum over tp left out:
    320 weights of 34,000, caught by their own tensors' means); the embedding's from one rank
    only (a tied copy not synchronised). (A gradient summed instead of averaged is invisible
    here: with the same scale every step and clipping, AdamW's update does not change.)"""
    model, (a, b) = _tiny_gpt_grads()
    mean = {n: (a[n] + b[n]) / 2 for n in a}
    reordered = {n: (b[n] + a[n]) * 0.5 for n in a}
    tol = adamw_weights(3, 1e-3)
    want = _train(model, [mean] * 3, clip=0.5)
    tol.assert_weights(_train(model, [reordered] * 3, clip=0.5), want, "reordered")
    for name, wrong in (("no all-reduce", a),
                        ("LayerNorms from one rank", {n: a[n] if "ln" in n else mean[n] for n in a}),
                        ("embedding from one rank", {n: a[n] if "wte" in n else mean[n] for n in a})):
        got = _train(model, [wrong] * 3, clip=0.5)
        largest = max((got[n] - want[n]).abs().max().item() for n in want)
        assert largest <= tol.atol, f"{name}: every weight within AdamW's step ({largest:.2g})"
        with pytest.raises(AssertionError, match="mean difference"):
            tol.assert_weights(got, want, name)


def test_one_assignment_moved_by_a_rounding_takes_whole_bias_steps_within_the_bias_bound():
    """Loss-free balancing (section 5): eight tokens, E = 4, k = 2, loads at the mean but for the
    last token, whose second choice is a near tie (0.5 against 0.5 + 1e-3, inside bf16's 2^-8).
    The two orders of that tie move two biases a whole step u apart. Over the sweep's 4 layers of
    4 experts after 3 steps that passes `expert_bias` in bf16 and fails in fp32; a bias never moved
    or moved twice a step fails in bf16 too."""
    from reference.expert_parallel.router import Router

    u, E = 0.05, 4
    pairs = [(0, 1), (0, 1), (0, 2), (1, 2), (1, 3), (2, 3), (2, 3)]  # loads 3, 4, 4, 3 so far
    logits = torch.zeros(1, 8, E)
    for t, (a, b) in enumerate(pairs):
        logits[0, t, a], logits[0, t, b] = 1.0, 0.9
    biases = []
    for tie in (1e-3, -1e-3):  # the last token: expert 0, then expert 3 or expert 2
        router = Router(E, E, 2, None, bias_update_rate=u)
        with torch.no_grad():
            router.gate.weight.copy_(torch.eye(E))  # its input is its logits
        x = logits.clone()
        x[0, 7] = torch.tensor([1.0, 0.0, 0.5, 0.5 + tie])
        router(x)
        router.move_bias(router.step_tokens_per_expert)
        biases.append(router.expert_bias.clone())
    assert torch.equal((biases[0] - biases[1]).abs(), torch.tensor([0.0, 0.0, u, u]))

    g = torch.Generator().manual_seed(0)  # one process's biases after 3 steps of skewed loads
    loads = torch.randint(0, 300, (3, 4, E), generator=g).double()
    want = {f"h.{i}.ffn.router.expert_bias":
            u * torch.sign(loads[:, i].mean(-1, keepdim=True) - loads[:, i]).sum(0) for i in range(4)}
    got = dict(want)
    got["h.2.ffn.router.expert_bias"] = want["h.2.ffn.router.expert_bias"] + biases[0] - biases[1]
    expert_bias(3, u, torch.bfloat16).assert_weights(got, want, "a tie sent the other way")
    with pytest.raises(AssertionError, match="mean difference"):
        expert_bias(3, u, torch.float32).assert_weights(got, want, "fp32")
    for name, wrong in (("never moved", {n: torch.zeros(E) for n in want}),
                        ("moved twice a step", {n: 2 * b for n, b in want.items()})):
        with pytest.raises(AssertionError, match="mean difference"):
            expert_bias(3, u, torch.bfloat16).assert_weights(wrong, want, name)


def test_sgd_weights_follow_the_gradient_bound():
    tol = sgd_weights(3, 0.1, n=4)
    assert tol.atol == pytest.approx(gradient(4).atol + 3 * 0.1 * (gradient(4).atol + gradient(4).rtol))


# ---------------------------------------------------------------- no notebook has its own
_LITERAL = re.compile(r"\b\d+(\.\d+)?e-\d+\b|\b(rtol|atol|rel_tol|abs_tol)\s*=\s*[0-9.]")
_COMPARES = re.compile(r"\bassert\b|assert_close|allclose|isclose")


def _literal_tolerances(paths):
    found = []
    for path in paths:
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "code":
                continue
            for line in "".join(cell["source"]).splitlines():
                code = line.split("#")[0]
                if _COMPARES.search(code) and _LITERAL.search(code):
                    found.append(f"{path.name} {cell.get('id')}: {line.strip()}")
    return found


def test_no_notebook_asserts_a_literal_tolerance():
    """Every comparison a lecture notebook asserts takes its tolerance from the policy."""
    found = _literal_tolerances(sorted((ROOT / "notebooks").glob("*.ipynb")))
    assert not found, "literal tolerances in notebook asserts:\n" + "\n".join(found)


def test_the_literal_finder_finds_each_form(tmp_path):
    nb = {"cells": [{"cell_type": "code", "id": f"c{i}", "source": [src]} for i, src in enumerate([
        "assert gap < 1e-5 * x", "torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)",
        "ok = torch.allclose(a, b, atol=0.001)", "assert math.isclose(a, b, rel_tol=2e-9)",
        "assert gap < loss().rtol * x  # fine: 1e-5 in a comment", "tol.assert_close(a, b)"])]}
    path = tmp_path / "x.ipynb"
    path.write_text(json.dumps(nb))
    assert [f.split(":")[0] for f in _literal_tolerances([path])] == [f"x.ipynb c{i}" for i in range(4)]


def test_the_policy_is_a_frozen_value():
    tol = forward()
    with pytest.raises(Exception):
        tol.rtol = 1.0  # type: ignore[misc]
    assert isinstance(adamw_weights(3, 1e-3), Tolerance)


# ---------------------------------------------------------------- make numerics covers every value
def _make_list(name: str) -> list[str]:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    (line,) = [l for l in text.splitlines() if l.startswith(f"{name} ?=")]
    return line.split("?=", 1)[1].split()


def test_make_numerics_covers_every_value_of_every_factor():
    """Each kernel family (ATen's and MKL's) and each thread count appears in a setting, the
    AVX-512 ones among the settings a CPU with AVX-512 adds; the notebooks run in each."""
    settings = [dict(kv.split("=") for kv in s.split(","))
                for s in _make_list("NUMERICS_SETTINGS") + _make_list("NUMERICS_AVX512")]
    seen = {k: {s.get(k, "machine") for s in settings}
            for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "COURSE_RANK_THREADS")}
    assert seen["ATEN_CPU_CAPABILITY"] >= {"machine", "default", "avx2", "avx512"}
    assert seen["MKL_CBWR"] >= {"machine", "AVX2", "COMPATIBLE", "AVX512"}
    assert seen["COURSE_RANK_THREADS"] == {"1", "2"}
    assert all("avx512" not in s.lower() for s in _make_list("NUMERICS_SETTINGS"))
    assert any("test_notebooks.py" in t for t in _make_list("NUMERICS_TESTS"))
    second = _make_list("SECOND_KERNELS")
    assert {"MKL_CBWR=COMPATIBLE", "ATEN_CPU_CAPABILITY=avx2"} <= set(second)
