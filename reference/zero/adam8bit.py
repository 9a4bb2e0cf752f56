"""8-bit optimizer state: AdamW whose two moments are stored block-wise quantised in 8 bits.

Adam keeps two moments per parameter, m and v: 8 bytes in fp32, twice the weights. Dettmers
et al. (2022, "8-bit Optimizers via Block-wise Quantization") cut each flattened moment into
blocks of `block_size` numbers (256), each with one fp32 scale (its absmax) and 8-bit codes
of its numbers divided by that scale. Every step dequantises, runs AdamW's update in fp32 and
requantises, one parameter at a time. Bytes of state per parameter, against 8 for fp32 Adam:

    1 (m, int8) + 1 (v, uint8) + 2 * 4 / block_size (the scales)  =  2.03 with blocks of 256

(`adam8bit_state_bytes` counts them per tensor.) Blocks keep an outlier's damage local.

A code (`QuantCode`) is the sorted table of values an 8-bit index stands for; quantising picks
the nearest. `linear_code` spaces them evenly (error at most absmax / 254 for int8). The
default, `dynamic_code`, is the paper's tree code: after the sign bit, the leading zero bits
are a decimal exponent e and the bits after the first 1 a fraction f, value 10^-e (0.1 + 0.9 f),
so numbers far below their block's absmax keep a few significant bits instead of rounding to
0 (with a 1000x spread in a block, the linear code stores the small element's moments as 0 and
it stops moving).

The second moment is stored as sqrt(v) (bitsandbytes stores v). v spans the *square* of the
gradients' range: with a 1e4 spread in a block, the small element's v is 1e-8 of the absmax,
below the dynamic code's smallest value (1e-7); stored as 0 under a nonzero m, the update
divides by eps and the element jumps by thousands of lr. sqrt(v) spans the gradients' own range
and is what the update divides by, for the same bytes. `tests/test_adam8bit.py` trains such a
block for 200 steps against fp32 AdamW.

Data parallelism never communicates optimizer state, so 8 bits save memory (6 of 8 bytes per
parameter, on every rank), not communication. Unlike bitsandbytes (small tensors in fp32),
every tensor is quantised, so the bytes follow the formula exactly.
"""
from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

__all__ = ["Adam8bit", "QuantCode", "linear_code", "dynamic_code", "quantize_blockwise",
           "dequantize_blockwise", "adam8bit_state_bytes", "CODES"]


class QuantCode:
    """The values (sorted, in [-1, 1] or [0, 1], holding 0 and 1) that 8-bit codes stand for:
    255 signed ones stored as int8 -127..127 (index - 127), or 256 unsigned ones as uint8."""

    def __init__(self, name: str, values: torch.Tensor, signed: bool):
        values = values.to(torch.float32)
        expected = 255 if signed else 256
        if values.numel() != expected or not bool((values.diff() > 0).all()):
            raise ValueError(f"a {'signed' if signed else 'unsigned'} code needs {expected} "
                             f"increasing values, got {values.numel()}")
        self.name, self.values, self.signed = name, values, signed
        self.offset = 127 if signed else 0
        self.dtype = torch.int8 if signed else torch.uint8
        self.midpoints = (values[1:] + values[:-1]) / 2  # (K - 1,): bucketize picks the nearest value

    @property
    def max_error(self) -> float:
        """Largest rounding error of one element, in units of its block's absmax: half the widest gap."""
        return float(self.values.diff().max()) / 2

    def __repr__(self) -> str:
        return f"QuantCode({self.name!r}, {'int8' if self.signed else 'uint8'}, max_error={self.max_error:.3g})"


@functools.lru_cache(maxsize=None)
def linear_code(signed: bool = True) -> QuantCode:
    """k / 127 for k = -127..127 (int8), or k / 255 for k = 0..255 (uint8)."""
    if signed:
        return QuantCode("linear", torch.arange(-127, 128, dtype=torch.float64) / 127, True)
    return QuantCode("linear", torch.arange(256, dtype=torch.float64) / 255, False)


@functools.lru_cache(maxsize=None)
def dynamic_code(signed: bool = True) -> QuantCode:
    """The dynamic (tree) code: of the 7 bits after the sign (8 unsigned), e leading zeros then a 1
    give the exponent, the other 6 - e bits a fraction: 10^-e (0.1 + 0.9 (k + 1) / 2^(6-e)). All zeros is 0."""
    bits = 7 if signed else 8
    positive = [10.0 ** -e * (0.1 + 0.9 * (k + 1) / 2 ** (bits - 1 - e))
                for e in range(bits) for k in range(2 ** (bits - 1 - e))]  # 127 (255) values
    positive = torch.tensor(sorted(positive), dtype=torch.float64)
    zero = torch.zeros(1, dtype=torch.float64)
    values = torch.cat([-positive.flip(0), zero, positive]) if signed else torch.cat([zero, positive])
    return QuantCode("dynamic", values, signed)


CODES = {"dynamic": dynamic_code, "linear": linear_code}


def quantize_blockwise(x: torch.Tensor, code: QuantCode, block_size: int = 256):
    """(codes, absmax): `x`'s numbers as 8-bit codes (x's shape) and one fp32 absmax per block of
    `block_size` numbers of the flattened tensor: |x - dequantised| <= absmax * code.max_error."""
    if not code.signed and bool((x < 0).any()):
        raise ValueError(f"the unsigned {code.name} code holds numbers >= 0 only; "
                         f"got a minimum of {float(x.min())}")
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    n_blocks = -(-n // block_size)
    blocks = F.pad(flat, (0, n_blocks * block_size - n)).view(n_blocks, block_size)  # (nb, B)
    absmax = blocks.abs().amax(dim=1)  # (nb,)
    scaled = blocks / torch.where(absmax > 0, absmax, 1.0)[:, None]  # (nb, B), in [-1, 1]
    index = torch.bucketize(scaled, code.midpoints.to(x.device))  # (nb, B): nearest value's index
    # Slice before converting: the codes own n bytes, not the padded block's storage.
    codes = (index.reshape(-1)[:n] - code.offset).to(code.dtype).view(x.shape)
    return codes, absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: QuantCode,
                         block_size: int = 256) -> torch.Tensor:
    """The fp32 numbers that `codes` and the blocks' `absmax` stand for (codes' shape)."""
    n = codes.numel()
    n_blocks = absmax.numel()
    if n_blocks != -(-n // block_size):
        raise ValueError(f"{n} codes in blocks of block_size={block_size} make "
                         f"{-(-n // block_size)} blocks, but absmax holds {n_blocks} scales")
    values = code.values.to(codes.device)[codes.reshape(-1).long() + code.offset]  # (n,) in [-1, 1]
    blocks = F.pad(values, (0, n_blocks * block_size - n)).view(n_blocks, block_size)
    return (blocks * absmax[:, None]).reshape(-1)[:n].view(codes.shape)


def adam8bit_state_bytes(numels, block_size: int = 256) -> int:
    """Bytes of `Adam8bit`'s state for tensors of these numels: 2 n + 2 * 4 * ceil(n / block_size) each."""
    return sum(2 * n + 2 * 4 * -(-n // block_size) for n in numels)


class Adam8bit(torch.optim.Optimizer):
    """AdamW with both moments stored block-wise quantised in 8 bits.

        opt = Adam8bit(model.parameters(), lr=1e-3, weight_decay=0.0)

    The update is torch.optim.AdamW's, in fp32 on the dequantised moments. Per parameter the
    state holds `exp_avg_codes` (int8, m), `exp_avg_sq_codes` (uint8, sqrt(v)), their `*_absmax`
    (fp32, one per block) and `step`. `code`: "dynamic" or "linear" (unsigned for sqrt(v)).
    """

    decoupled_weight_decay = True  # AdamW's p *= 1 - lr wd: what `ZeroOptimizer` asks (zero/groups.py)

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, block_size: int = 256,
                 code: str = "dynamic"):
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0 (it keeps m / (sqrt(v) + eps) finite), got {eps!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int (numbers per absmax), got {block_size!r}")
        if code not in CODES:
            raise ValueError(f"code must be one of {sorted(CODES)}, got {code!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        block_size=block_size, code=code)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd, block = group["lr"], group["eps"], group["weight_decay"], group["block_size"]
            code_m, code_v = CODES[group["code"]](True), CODES[group["code"]](False)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("Adam8bit does not support sparse gradients")
                grad = p.grad.to(torch.float32)
                state = self.state[p]
                if not state:  # zero moments: code 0 stands for 0 in both codes
                    n_blocks = -(-p.numel() // block)
                    state["step"] = 0
                    state["exp_avg_codes"] = torch.zeros_like(p, dtype=torch.int8)
                    state["exp_avg_absmax"] = torch.zeros(n_blocks, dtype=torch.float32, device=p.device)
                    state["exp_avg_sq_codes"] = torch.zeros_like(p, dtype=torch.uint8)
                    state["exp_avg_sq_absmax"] = torch.zeros(n_blocks, dtype=torch.float32, device=p.device)
                # The fp32 moments of this parameter only; the second is stored as sqrt(v).
                m = dequantize_blockwise(state["exp_avg_codes"], state["exp_avg_absmax"], code_m, block)
                v = dequantize_blockwise(state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], code_v, block).square()
                state["step"] += 1
                t = state["step"]
                # AdamW, in torch.optim.AdamW's order of operations.
                p.mul_(1 - lr * wd)                                  # decoupled weight decay
                m.lerp_(grad, 1 - beta1)                             # m = b1 m + (1 - b1) g
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # v = b2 v + (1 - b2) g^2
                denom = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
                p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-lr / (1 - beta1 ** t))
                # Requantise for storage until the next step.
                state["exp_avg_codes"], state["exp_avg_absmax"] = quantize_blockwise(m, code_m, block)
                state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"] = quantize_blockwise(v.sqrt(), code_v, block)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, then the saved codes and scales put back unchanged (torch casts every
        saved tensor to its parameter's dtype, which would turn int8 codes into floats)."""
        super().load_state_dict(state_dict)
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if saved is None:
                continue
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(p.device)
