"""Gradient compression for data parallelism: fewer bytes per all-reduce, paid for in accuracy.

Data parallelism all-reduces 2(N-1)/N * 4 Psi bytes per rank and step in fp32. Two ways to
send less:

* **bf16 compression**: each bucket cast to bfloat16 for the all-reduce, exactly half the
  bytes. bf16 keeps fp32's exponent but 8 bits of significand, so each rank's g / N and the
  sum are rounded to 2^-8 of themselves. `CompressedDDP` does it for the course's `DDP`,
  PyTorch's DDP with the comm hook ``default_hooks.bf16_compress_hook`` (it casts, then
  divides: the same bits when N is a power of two).
* **PowerSGD** (Vogels et al., 2019): each gradient matrix M (n x m, (shape[0], rest)) is
  replaced by a rank-r P Q^T: with Q from the previous step, P = M Q is all-reduced and
  orthogonalised, then Q = M^T P all-reduced, n r + m r numbers instead of n m. Error feedback
  adds what was missed to the next step's gradient. Vectors and matrices too small to gain are
  sent whole. PyTorch's ``powerSGD_hook`` implements it; `powersgd_bytes` gives its bytes.

PyTorch's hooks call ``torch.distributed`` directly, so `metered_comm_hook(hook)` records the
all-reduces a hook issues in the open `CommMeter`s (giving up the overlap). Compression changes
the gradient, so unlike the rest of the package it does not reproduce single-process training:
`tests/test_compression.py` measures by how much.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference import comms
from reference.data_parallel.ddp import DDP

__all__ = ["CompressedDDP", "metered_comm_hook", "powersgd_bytes", "PowerSGDBytes", "gpt_gradient_shapes"]

COMPRESS_DTYPES = (torch.bfloat16, torch.float16)


class _Decompress:
    """The work of one compressed all-reduce; ``wait()`` copies the sum back into the fp32 bucket."""

    def __init__(self, work, compressed: torch.Tensor, flat: torch.Tensor):
        self.work, self.compressed, self.flat = work, compressed, flat

    def wait(self) -> bool:
        self.work.wait()
        self.flat.copy_(self.compressed)  # (numel,) bf16 -> fp32: the mean over ranks
        return True


class CompressedDDP(DDP):
    """The course's `DDP` with each bucket all-reduced in `dtype` (bf16 by default): half the bytes.

        ddp = CompressedDDP(model.to(device()), bucket_cap_mb=1)   # any DDP argument
    """

    def __init__(self, module, dtype: torch.dtype = torch.bfloat16, **ddp_kwargs):
        if dtype not in COMPRESS_DTYPES:
            raise ValueError(f"dtype must be one of {COMPRESS_DTYPES} (a 16-bit float to send "
                             f"gradients in), got {dtype!r}")
        super().__init__(module, **ddp_kwargs)
        self.compress_dtype = dtype
        for b in self.buckets:
            if b.dtype != torch.float32:
                self.remove_hooks()
                raise ValueError(f"CompressedDDP compresses fp32 gradients; bucket {b.index} holds "
                                 f"{b.dtype} ({', '.join(b.names)})")

    def _all_reduce_bucket(self, flat: torch.Tensor):
        compressed = flat.to(self.compress_dtype)  # (numel,) each rank's g / N, rounded to 16 bits
        work = comms.all_reduce(compressed, group=self.group, async_op=True)
        return _Decompress(work, compressed, flat)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", compress_dtype={self.compress_dtype}"


# ------------------------------------------------------------- PyTorch's comm hooks
@contextlib.contextmanager
def _metered_torch_all_reduce():
    """While open, every ``torch.distributed.all_reduce`` call is recorded in the open meters."""
    original = dist.all_reduce

    def recorded(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        n, i = dist.get_world_size(group), dist.get_rank(group)
        comms.record("all_reduce", group, tensor.numel() * tensor.element_size(),
                     comms.ring_sent_bytes("all_reduce", tensor.numel(), tensor.element_size(), n, i))
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = recorded
    try:
        yield
    finally:
        dist.all_reduce = original


def metered_comm_hook(hook):
    """A DDP comm hook that runs `hook` and records each all-reduce it issues in the open meters.

        ddp.register_comm_hook(state, metered_comm_hook(powerSGD_hook))

    The hook's future is waited for inside, so its callbacks' all-reduces (PowerSGD's P, then Q)
    count too. The wrapper is named ``metered_<hook>``: PyTorch refuses ``bf16_compress_hook``
    *by name* without CUDA and NCCL 2.10+, and gloo sums bf16 too, so it also runs on CPU ranks.
    """
    def wrapper(state, bucket):
        with _metered_torch_all_reduce():
            value = hook(state, bucket).wait()
        done = torch.futures.Future()
        done.set_result(value)
        return done

    wrapper.__name__ = wrapper.__qualname__ = f"metered_{getattr(hook, '__name__', 'hook')}"
    wrapper.__doc__ = hook.__doc__
    return wrapper


@dataclass(frozen=True)
class PowerSGDBytes:
    """Bytes PyTorch's ``powerSGD_hook`` all-reduces in one compressed step, by kind."""

    p: int             # the P matrices, n r numbers per compressed matrix
    q: int             # the Q matrices, m r numbers per compressed matrix
    uncompressed: int  # vectors and matrices too small to gain, whole
    dense: int         # every gradient whole: what plain data parallelism all-reduces

    @property
    def total(self) -> int:
        return self.p + self.q + self.uncompressed

    @property
    def ratio(self) -> float:
        """How many times fewer bytes than the dense all-reduce."""
        return self.dense / self.total


def powersgd_bytes(shapes: Iterable[tuple[int, ...]], rank: int, min_compression_rate: float = 2,
                   element_size: int = 4) -> PowerSGDBytes:
    """Payload bytes of one compressed PowerSGD step over gradients of these `shapes` (its first
    ``start_powerSGD_iter`` steps are plain all-reduces). Each tensor, viewed as (n, m), with
    r = min(n, m, rank), sends n r + m r numbers when (n + m) r * min_compression_rate < n m
    (PyTorch's rule), else n m."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int (the approximation's rank r), got {rank!r}")
    p = q = whole = dense = 0
    for shape in shapes:
        shape = tuple(shape)
        if not shape:
            raise ValueError("PowerSGD views each gradient as (shape[0], rest): got a 0-d tensor")
        n = shape[0]
        m = int(torch.Size(shape).numel()) // n if n else 0
        r = min(n, m, rank)
        dense += n * m
        if (n + m) * r * min_compression_rate < n * m:
            p, q = p + n * r, q + m * r
        else:
            whole += n * m
    return PowerSGDBytes(p * element_size, q * element_size, whole * element_size, dense * element_size)


def gpt_gradient_shapes(config) -> list[tuple[int, ...]]:
    """The shapes of the gradients of ``GPT(config)`` (a tied weight once), without building it:
    for `powersgd_bytes` of a model too large to build on a laptop (GPT-3 1.3B)."""
    c, f = config.n_embd, config.d_ff
    norm = [(c,)] * (2 if config.bias else 1)  # weight (and bias)

    def linear(n_in: int, n_out: int) -> list:
        return [(n_out, n_in)] + ([(n_out,)] if config.bias else [])

    block = norm + linear(c, 3 * c) + linear(c, c) + norm + linear(c, f) + linear(f, c)
    head = [] if config.tie_weights else [(config.vocab_size, c)]
    return [(config.vocab_size, c), (config.block_size, c)] + config.n_layer * block + norm + head
