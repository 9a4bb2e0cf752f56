"""How close a run must be to one process: the course's one tolerance policy.

    from reference.tolerance import forward, gradient, loss, adamw_weights, exact
    torch.testing.assert_close(y, y_one, **forward())        # a Tolerance unpacks as rtol=, atol=
    gradient(n=4).assert_close(g, g_one, "rank 1 wte")       # summed over 4 ranks in another order
    tol = adamw_weights(steps=3, lr=1e-3)                     # weights after 3 AdamW steps
    tol.assert_weights(state, state_one)                      # every weight, and their mean
    exact().assert_close(a, b)                                # bit for bit, where a run is exact

Every comparison of a parallel run with one process (the tests, the all-pairs sweep, the
homework judges, the notebooks' asserts) takes its numbers from here, so a machine whose kernels
round differently moves every check the same way. A run that does the same arithmetic in the
same order is held to `exact()`: bit for bit stays bit for bit.

Why machines differ. A parallel run computes one process's sums in another order (a
tensor-parallel partial sum added over ranks, a gradient summed over ranks or micro-batches, a
loss split over vocabulary shards), and the order inside one matrix product depends on the CPU
too (ATen's AVX-512/AVX2 kernels, `ATEN_CPU_CAPABILITY`; MKL's code path, `MKL_CBWR`). So the
bounds below are about reordered sums, never about what one machine printed.

Units. A float's unit roundoff u is half the distance from 1 to the next number: 2^-24 (fp32),
2^-11 (fp16), 2^-8 (bf16). One rounding moves a result by at most u relative.

1. A forward, a loss or a gradient in fp32 (`forward`, `loss`, `gradient`): rtol 1e-5, atol
   1e-6. Adding n terms in two orders gives results within 2(n-1)u of each other relative to
   the sum of the terms' magnitudes (each order is within (n-1)u of the exact sum; Higham,
   "Accuracy and Stability of Numerical Algorithms", section 4.2). That worst case assumes
   every rounding goes the same way; independent roundings add up as sqrt(n) u (Higham and
   Mary, "A New Approach to Probabilistic Rounding Error Analysis", 2019). The course's
   reductions add at most a few thousand terms (n <= 4096 gives sqrt(n) u = 3.8e-6 per
   reduction), through a few layers: rtol 1e-5, 168 u, covers it. The atol covers results
   near zero, whose error is relative to the terms: the course's activations and gradients are
   at most of order 1, so 1e-6 is 17 u of them. `gradient(n)` adds the 2(n-1)u of a sum over n
   ranks or micro-batches (n = 8 adds 8e-7). Values of order s take `tol.at_scale(s)`: the atol
   grows with the terms. float64: the same reasoning with its own u (rtol 1.9e-14, atol 1.9e-15).
2. bf16 and fp16 against one process in the same precision (`forward(dtype)`, `loss(dtype)`):
   each result is rounded once in each run, to the format's u, above sums rounded at other
   places: rtol 2.5 u of the format (1e-2 for bf16, 1.2e-3 for fp16), atol a tenth of that. A
   loss, a mean over thousands of roundings that do not line up, moves far less: rtol 1e-3.
3. Weights after k AdamW steps (`adamw_weights`). AdamW moves a weight by lr m/(sqrt(v) + eps)
   (bias-corrected moments), a ratio at most rho_k in size whatever the gradients (Cauchy-Schwarz
   on the two moments' weights; rho_1 = 1, rho_3 = 1.0036 for the default betas). A gradient
   near zero (its terms cancel, or it is smaller than eps) can take that whole step either way
   on a last-bit difference: the ratio's derivative there is 1/eps. So the one bound that holds
   on every machine is the largest difference 2 lr (rho_1 + ... + rho_k) (decoupled weight
   decay multiplies a difference by 1 - lr wd <= 1): 6.0e-3 for three steps at lr 1e-3. Such
   gradients are not rare: the bias of attention's keys has a gradient of exactly zero (softmax
   ignores a shift common to every key of a query), so it receives rounding alone, divided by
   eps. That bound only catches a weight gone astray; a wrong reduction (no all-reduce, a
   LayerNorm's gradient not summed over tp, a tied copy not synchronised) moves most weights of
   the tensors it touches by a good fraction of lr. So the *mean* difference is held to a share
   of the bound: 1/1000 in fp32 (a correct run has far fewer than one weight in a thousand whose
   gradient is within its rounding of zero), 1/50 in fp16 and 1/10 in bf16 (roundings 2^13 and
   2^16 times coarser put many more gradients within reach of zero); over all the compared
   weights, and over each tensor with one weight's whole step allowed on top (so a 32-weight
   LayerNorm is held too).
4. Weights after k SGD steps (`sgd_weights`): SGD moves a weight by lr times its gradient, so a
   gradient difference within `gradient(n)` (gradients of order 1 at most, as in section 1)
   moves it by at most lr (atol + rtol) each step.
5. The experts' bias after k steps of loss-free balancing (`expert_bias`). It is not trained: each
   step moves b_i by u sign(mean load - load_i), the loads being counts of the tokens' choices.
   A choice is discrete: a token whose two best scores are within a rounding of each other goes
   to either expert, and a bf16 or fp16 run rounds its activations differently from one process
   (section 2), so a few assignments in thousands go elsewhere. One assignment moved changes the
   sign of an expert whose load is at or next to the mean, and its bias by u or 2u that step.
   So, as a weight near zero gradient in section 3, the one bound is the rule's whole range,
   2 u k; the mean over the biases is held to the same share of it as the weights' (one bias in
   a layer of E can take the whole range, as one weight can). In fp32 the choices and the loads
   are one process's; the share of 1/1000 catches one bias a step apart among fewer than 500 / k.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["Tolerance", "UNIT_ROUNDOFF", "exact", "forward", "gradient", "loss",
           "adamw_ratio_bound", "adamw_weights", "sgd_weights", "expert_bias"]

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8,
                 torch.float64: 2.0 ** -53}
FP32 = dict(rtol=1e-5, atol=1e-6)          # section 1 of the docstring
HALF_LOSS_RTOL = 1e-3                      # section 2: a loss in bf16 or fp16
MEAN_SHARE = {torch.float64: 1e-3, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 1e-1}  # section 3


@dataclass(frozen=True)
class Tolerance:
    """|got - want| <= atol + rtol |want| for every element and, where `mean_atol` is set, their
    mean |got - want| <= mean_atol. Unpacks as rtol=, atol=; `why` is printed with any failure."""

    rtol: float
    atol: float
    why: str
    mean_atol: float | None = None

    # ---- as rtol=, atol= keyword arguments
    def keys(self):
        return ("rtol", "atol")

    def __getitem__(self, key: str) -> float:
        if key not in ("rtol", "atol"):
            raise KeyError(key)
        return getattr(self, key)

    # ---- numbers
    def allows(self, diff: float, scale: float = 0.0) -> bool:
        """Whether a difference `diff` is within the tolerance of a value of size `scale`."""
        return abs(diff) <= self.atol + self.rtol * abs(scale)

    def excess(self, got: torch.Tensor, want: torch.Tensor) -> float:
        """The largest |got - want| - (atol + rtol |want|): <= 0 when every element is within."""
        got, want = _as_double(got), _as_double(want)
        if got.numel() == 0:
            return 0.0
        return ((got - want).abs() - self.atol - self.rtol * want.abs()).max().item()

    def close(self, got, want) -> bool:
        got, want = _as_double(got), _as_double(want)
        return got.shape == want.shape and bool(torch.isfinite(got).all()) and self.excess(got, want) <= 0

    def assert_close(self, got, want, what: str = "") -> None:
        """Raise AssertionError naming `what`, the largest difference and the reason."""
        got_d, want_d = _as_double(got), _as_double(want)
        if got_d.shape != want_d.shape:
            raise AssertionError(f"{what}: shape {tuple(got_d.shape)} against {tuple(want_d.shape)}")
        if not self.close(got_d, want_d):
            diff = (got_d - want_d).abs().max().item() if got_d.numel() else 0.0
            raise AssertionError(f"{what}: largest difference {diff:.3g} beyond rtol {self.rtol:g}, "
                                 f"atol {self.atol:g} ({self.why})")

    def assert_losses(self, got: Iterable[float], want: Iterable[float], what: str = "losses") -> None:
        got, want = list(map(float, got)), list(map(float, want))
        if len(got) != len(want):
            raise AssertionError(f"{what}: {len(got)} values against {len(want)}")
        for i, (a, b) in enumerate(zip(got, want)):
            if not (math.isfinite(a) and self.allows(a - b, b)):
                raise AssertionError(f"{what}[{i}]: {a!r} against {b!r} beyond rtol {self.rtol:g}, "
                                     f"atol {self.atol:g} ({self.why})")

    def assert_weights(self, got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                       what: str = "") -> None:
        """Every tensor of `want` within the tolerance in `got`; where `mean_atol` is set, the mean
        over all of them within it, and each tensor's within it plus atol / numel (section 3)."""
        missing = sorted(set(want) - set(got))
        if missing:
            raise AssertionError(f"{what}: missing {missing[:5]}")
        total, count = 0.0, 0
        for name in want:
            label = f"{what} {name}".strip()
            self.assert_close(got[name], want[name], label)
            d = (_as_double(got[name]) - _as_double(want[name])).abs()
            total, count = total + d.sum().item(), count + d.numel()
            if self.mean_atol is not None and d.numel():
                allowed = self.mean_atol + self.atol / d.numel()
                if d.mean().item() > allowed:
                    raise AssertionError(f"{label}: mean difference {d.mean().item():.3g} over its "
                                         f"{d.numel()} weights beyond {allowed:.3g} ({self.why})")
        if self.mean_atol is not None and count and total / count > self.mean_atol:
            raise AssertionError(f"{what}: mean difference {total / count:.3g} over {count} weights "
                                 f"beyond {self.mean_atol:.3g} ({self.why})")

    def at_scale(self, scale: float) -> "Tolerance":
        """The same tolerance for values of order `scale` rather than 1: the atol grows with them."""
        if not scale > 0:
            raise ValueError(f"at_scale({scale}): a scale is a positive magnitude")
        mean = None if self.mean_atol is None else self.mean_atol * scale
        return Tolerance(self.rtol, self.atol * scale, f"{self.why}, values of order {scale:g}", mean)

    def summary(self) -> str:
        mean = "" if self.mean_atol is None else f", mean {self.mean_atol:.2g}"
        return f"rtol {self.rtol:.2g}, atol {self.atol:.2g}{mean}"


def _as_double(x) -> torch.Tensor:
    return torch.as_tensor(x).detach().cpu().double()


def _check_dtype(dtype) -> None:
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no tolerance for {dtype}: the course compares float64, float32, float16 "
                         f"and bfloat16 runs")


def exact() -> Tolerance:
    """Bit for bit: the same arithmetic in the same order (a copy, a gather, a layout change)."""
    return Tolerance(0.0, 0.0, "the same arithmetic in the same order: bit for bit")


def forward(dtype: torch.dtype = torch.float32) -> Tolerance:
    """A forward's outputs (or a single reduction) against one process's in the same precision."""
    _check_dtype(dtype)
    if dtype is torch.float32:
        return Tolerance(**FP32, why="fp32, the same sums added in another order (section 1)")
    if dtype is torch.float64:      # section 1's reasoning, with float64's u: 2^-29 times fp32's
        ratio = UNIT_ROUNDOFF[torch.float64] / UNIT_ROUNDOFF[torch.float32]
        return Tolerance(FP32["rtol"] * ratio, FP32["atol"] * ratio,
                         "fp64, the same sums added in another order (section 1)")
    rtol = 2.5 * UNIT_ROUNDOFF[dtype]
    return Tolerance(rtol, rtol / 10, f"{str(dtype)[6:]}: one rounding of each result above "
                                      f"reordered sums (section 2)")


def gradient(n: int = 1, dtype: torch.dtype = torch.float32) -> Tolerance:
    """A gradient summed over `n` ranks or micro-batches in another order than one process's."""
    if n < 1:
        raise ValueError(f"gradient(n={n}): n counts the partial sums added, at least 1")
    base = forward(dtype)
    extra = 2 * (n - 1) * UNIT_ROUNDOFF[dtype]
    return Tolerance(base.rtol + extra, base.atol + extra,
                     f"{base.why}, summed over {n} in another order (section 1)")


def loss(dtype: torch.dtype = torch.float32) -> Tolerance:
    """A loss (a mean over the batch's tokens) against one process's in the same precision."""
    _check_dtype(dtype)
    if dtype in (torch.float32, torch.float64):
        return Tolerance(forward(dtype).rtol, 0.0,
                         f"{str(dtype)[6:]} loss, the same sums added in another order (section 1)")
    return Tolerance(HALF_LOSS_RTOL, 0.0, f"{str(dtype)[6:]} loss: a mean over roundings that do not "
                                          f"line up (section 2)")


def adamw_ratio_bound(step: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest |m_hat / sqrt(v_hat)| AdamW can take at `step` (1-based), over all gradients:
    m_hat = sum_i a_i g_i and v_hat = sum_i b_i g_i^2 with a_i = (1-b1) b1^(k-i) / (1-b1^k),
    b_i = (1-b2) b2^(k-i) / (1-b2^k); by Cauchy-Schwarz |m_hat| <= sqrt(sum a_i^2 / b_i) sqrt(v_hat)."""
    if step < 1:
        raise ValueError(f"adamw_ratio_bound(step={step}): steps count from 1")
    b1, b2 = betas
    total = 0.0
    for i in range(1, step + 1):
        a = (1 - b1) * b1 ** (step - i) / (1 - b1 ** step)
        b = (1 - b2) * b2 ** (step - i) / (1 - b2 ** step)
        total += a * a / b
    return math.sqrt(total)


def adamw_weights(steps: int, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                  dtype: torch.dtype = torch.float32) -> Tolerance:
    """Weights after `steps` AdamW (or Adam) steps at learning rate `lr` against one process's:
    any weight within 2 lr (rho_1 + ... + rho_k), their mean within a share of that (section 3)."""
    if steps < 1 or lr <= 0:
        raise ValueError(f"adamw_weights(steps={steps}, lr={lr}): at least one step, lr > 0")
    base = forward(dtype)  # refuses a dtype without a tolerance
    bound = 2 * lr * sum(adamw_ratio_bound(k, betas) for k in range(1, steps + 1))
    return Tolerance(base.rtol, bound + base.atol,
                     f"{steps} AdamW steps at lr {lr:g}: a near-zero gradient can take the whole step "
                     f"either way; the mean is held to {MEAN_SHARE[dtype]:g} of that (section 3)",
                     mean_atol=MEAN_SHARE[dtype] * bound)


def sgd_weights(steps: int, lr: float, n: int = 1, dtype: torch.dtype = torch.float32) -> Tolerance:
    """Weights after `steps` SGD steps at `lr`, gradients summed over `n` (section 4)."""
    if steps < 1 or lr <= 0:
        raise ValueError(f"sgd_weights(steps={steps}, lr={lr}): at least one step, lr > 0")
    g = gradient(n, dtype)
    # a gradient of order 1 at most (section 1) differs by at most g.atol + g.rtol
    return Tolerance(g.rtol, g.atol + steps * lr * (g.atol + g.rtol),
                     f"{steps} SGD steps at lr {lr:g}: each moves a weight by lr times a gradient "
                     f"within {g.summary()} (section 4)")


def expert_bias(steps: int, rate: float, dtype: torch.dtype = torch.float32) -> Tolerance:
    """The routers' biases after `steps` steps of loss-free balancing at update rate `rate` (u)
    against one process's: any bias within 2 u k, their mean within a share of that (section 5)."""
    if steps < 1 or not rate > 0:
        raise ValueError(f"expert_bias(steps={steps}, rate={rate}): at least one step, rate > 0")
    _check_dtype(dtype)
    bound = 2 * rate * steps
    return Tolerance(0.0, bound, f"{steps} bias steps of {rate:g}: a rounding can send a token to "
                                 f"another expert and flip a load's sign; the mean is held to "
                                 f"{MEAN_SHARE[dtype]:g} of that (section 5)",
                     mean_atol=MEAN_SHARE[dtype] * bound)
