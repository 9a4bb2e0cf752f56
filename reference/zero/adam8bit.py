"""8-bit optimizer state: AdamW whose two moments are stored block-wise quantised in 8 bits.

Adam keeps two moments per parameter, m (the mean of the gradients) and v (the
mean of their squares): 8 bytes per parameter in fp32, twice the weights
themselves. Dettmers et al. (2022, "8-bit Optimizers via Block-wise
Quantization") store each moment in 8 bits instead:

* the moment, flattened, is cut into blocks of `block_size` numbers (default
  256); each block keeps one fp32 scale, its absmax, and 8-bit codes of its
  numbers divided by that scale (so they lie in [-1, 1]; sqrt(v) in [0, 1]);
* every step dequantises the moments, runs AdamW's update in fp32, and
  requantises them: the fp32 moments exist for one parameter at a time only.

Bytes per parameter of optimizer state, against 8 for fp32 Adam:

    1 (m, int8) + 1 (v, uint8) + 2 * 4 / block_size (the two moments' scales)

that is 2.03 bytes with blocks of 256 (`adam8bit_state_bytes` counts them
tensor by tensor, each tensor's last block possibly partial). Blocks keep an
outlier's damage local: one large number coarsens only its own block's grid.

**The code.** A code is the sorted table of the values an 8-bit index stands
for (a `QuantCode`); quantising a number picks the nearest entry. Two are here:

* `linear_code`: evenly spaced values, k / 127 for int8 (k = -127..127) and
  k / 255 for uint8. Error per element at most absmax / 254 (int8) and
  absmax / 510 (uint8), half the spacing.
* `dynamic_code` (the default), the paper's dynamic (tree) code: after the sign
  bit, the number of leading zero bits is a decimal exponent e and the bits
  after the first 1 a linear fraction, value = 10^-e * (0.1 + 0.9 * f). Numbers
  far below their block's absmax keep a few significant bits instead of
  rounding to 0. Error per element at most absmax * 0.9 / 128 for int8 (half
  the widest spacing, next to absmax) and absmax * 0.9 / 256 for uint8. (The
  paper's table and the one of bitsandbytes differ in small details: bin
  midpoints as values, one extra bit of fraction; the idea is the same.)

**The second moment is stored as its square root**, sqrt(v) (bitsandbytes
stores v itself). v spans the *square* of the gradients' range: in a block
whose largest gradient is 1e4 times an element's, that element's v is 1e-8 of
the block's absmax, below the dynamic code's smallest value (1e-7, and 1/510
for the linear code). Stored as 0 under a nonzero m, the next step divides m by
sqrt(0) + eps = 1e-8 and the element jumps by thousands of lr: training
diverges. sqrt(v) spans the gradients' own range (1e-4 of its absmax here,
inside the dynamic code's 8 decades), and is the number the update divides by,
so its rounding error reaches the update once, not halved by a square root.
The bytes are the same. What 8 bits still cost at such a spread: m of the small
elements, 1e-4 of its block's absmax, has only a few code values nearby, so
those elements move more slowly than fp32 Adam's (they no longer run away).
`tests/test_adam8bit.py` trains a 256-number block with gradients spread over
1e4 for 200 steps against fp32 AdamW.

Why the default code is dynamic: in a block whose largest gradient is 1000
times an element's, that element's m and sqrt(v) are 1/1000 of their absmax,
below half the linear grids' first steps (1/254 and 1/510): the linear code
stores both as 0 and the element stops moving; the dynamic code keeps them to
a few %.

**Memory, not communication.** In data parallelism the optimizer state is never
communicated: every rank keeps its own copy and only gradients are all-reduced.
Eight-bit state therefore saves memory (6 of Adam's 8 bytes per parameter, on
every rank), and communication only where the state itself travels: ZeRO's
sharded state gathered into a checkpoint, or offloaded to the CPU and brought
back. Bitsandbytes also keeps small tensors (under 4096 numbers) in fp32; here
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
    """The values (sorted, in [-1, 1] or [0, 1], holding 0 and 1) that 8-bit codes stand for.

    A signed code has 255 values stored as int8 -127..127 (index - 127); an
    unsigned one has 256 values stored as uint8 0..255.
    """

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
    """The dynamic (tree) code: a decimal exponent in unary, then a linear fraction.

    Of the 7 bits after the sign (8 bits when unsigned), e leading zeros then a 1
    give the exponent, and the remaining 6 - e bits (7 - e) a fraction f with
    2^(6-e) levels: values 10^-e * (0.1 + 0.9 * (k + 1) / 2^(6-e)), k = 0.. ,
    each decade (0.1, 1] * 10^-e sliced evenly. All bits zero is 0.
    """
    bits = 7 if signed else 8
    positive = [10.0 ** -e * (0.1 + 0.9 * (k + 1) / 2 ** (bits - 1 - e))
                for e in range(bits) for k in range(2 ** (bits - 1 - e))]  # 127 (255) values
    positive = torch.tensor(sorted(positive), dtype=torch.float64)
    zero = torch.zeros(1, dtype=torch.float64)
    values = torch.cat([-positive.flip(0), zero, positive]) if signed else torch.cat([zero, positive])
    return QuantCode("dynamic", values, signed)


CODES = {"dynamic": dynamic_code, "linear": linear_code}


def quantize_blockwise(x: torch.Tensor, code: QuantCode, block_size: int = 256):
    """(codes, absmax): `x`'s numbers as 8-bit codes (x's shape) and one fp32 absmax per block.

    Blocks are `block_size` consecutive numbers of the flattened tensor; the
    last may be shorter. Each number becomes the index of the code value
    nearest to x / absmax of its block, so |x - dequantised| <= absmax * code.max_error.
    """
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
    """Bytes of `Adam8bit`'s state for tensors of these numels: 2 n + 2 * 4 * ceil(n / block_size) each.

    One int8 and one uint8 code per number, one fp32 absmax per block of each
    moment. When `block_size` divides every numel: (2 + 8 / block_size) per parameter.
    """
    return sum(2 * n + 2 * 4 * -(-n // block_size) for n in numels)


class Adam8bit(torch.optim.Optimizer):
    """AdamW with both moments stored block-wise quantised in 8 bits.

        opt = Adam8bit(model.parameters(), lr=1e-3, weight_decay=0.0)

    The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected
    moments), computed in fp32 on the dequantised moments; only the storage of
    the moments differs. Per parameter the state holds `exp_avg_codes` (int8,
    the parameter's shape, m), `exp_avg_sq_codes` (uint8, sqrt(v): the module's
    docstring says why the root), their `*_absmax` (fp32,
    one per block) and `step` (a Python int). `code` is "dynamic" (default) or
    "linear"; the second moment uses its unsigned variant.
    """

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
                # Dequantise: the fp32 moments of this parameter only, (p.shape) each.
                # The second moment is stored as sqrt(v) (the module's docstring says why).
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
                state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"] = quantize_blockwise(v.sqrt(), code_v, block)  # sqrt(v)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, then the saved codes and scales put back as saved.

        torch.optim.Optimizer casts every saved tensor to its parameter's dtype,
        which would turn int8 codes into floats (and bf16 parameters would round
        the fp32 scales); the saved tensors are restored unchanged instead.
        """
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
