"""The alpha-beta cost model of a collective.

Sending one message of n bytes takes ``alpha + n * beta`` seconds: alpha is the
latency paid per message (seconds), beta the inverse bandwidth (seconds per
byte). A collective made of steps that run side by side on every link costs
(number of steps) * alpha + (bytes each rank sends one after the other) * beta.
For the ring algorithms of `reference.comms.ring` on N ranks, with n the size
of the whole tensor in bytes:

    all_reduce      2(N-1) alpha + 2(N-1)/N n beta      (reduce-scatter + all-gather)
    reduce_scatter   (N-1) alpha +  (N-1)/N n beta      (n = the input, all N chunks)
    all_gather       (N-1) alpha +  (N-1)/N n beta      (n = the output, all N chunks)
    all_to_all       (N-1) alpha +  (N-1)/N n beta      (n = one rank's input, split evenly;
                                                          N-1 pairwise exchanges)
    broadcast       (N-2+k)(alpha + n/k beta)           (pipelined chain, k pieces)
    send                   alpha +         n beta

With one rank every collective is free. All-reduce's bandwidth term tends to 2n beta as N
grows, hardly depending on the number of ranks: why the ring suits large gradients.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["CostModel", "COST_OPS"]

COST_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send")


def _coefficients(op: str, world_size: int, num_chunks: int | None = None) -> tuple[float, float]:
    """(a, b) such that time = a * alpha + b * nbytes * beta for `op` on `world_size` ranks."""
    n = int(world_size)
    if n < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if op == "send":
        return 1.0, 1.0
    if op not in COST_OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(COST_OPS)}")
    if n == 1:
        return 0.0, 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return float(n - 1), (n - 1) / n
    # broadcast: a chain of N-1 links, k pieces of n/k bytes, N-2+k steps
    k = n if num_chunks is None else int(num_chunks)
    if k < 1:
        raise ValueError(f"num_chunks must be at least 1, got {num_chunks}")
    steps = n - 2 + k
    return float(steps), steps / k


@dataclass(frozen=True)
class CostModel:
    """alpha: seconds per message; beta: seconds per byte (1 / bandwidth)."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"alpha and beta must be non-negative, got alpha={self.alpha}, beta={self.beta}")

    # -- constructors and presets ------------------------------------------
    @classmethod
    def from_bandwidth(cls, latency_s: float, bandwidth_bytes_per_s: float) -> "CostModel":
        """alpha = latency, beta = 1 / bandwidth (bytes per second)."""
        if bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
        return cls(alpha=float(latency_s), beta=1.0 / float(bandwidth_bytes_per_s))

    # Orders of magnitude for reasoning, not measurements of any one machine.
    @classmethod
    def nvlink(cls) -> "CostModel":
        """GPUs inside one node: a few microseconds, hundreds of GB/s."""
        return cls.from_bandwidth(5e-6, 200e9)

    @classmethod
    def infiniband(cls) -> "CostModel":
        """GPUs in different nodes: ~10 microseconds, tens of GB/s per GPU."""
        return cls.from_bandwidth(10e-6, 25e9)

    @classmethod
    def ethernet(cls) -> "CostModel":
        """Commodity 10 Gb/s Ethernet: tens of microseconds, about 1 GB/s."""
        return cls.from_bandwidth(50e-6, 1.25e9)

    @property
    def bandwidth(self) -> float:
        """Bytes per second, 1 / beta."""
        return float("inf") if self.beta == 0 else 1.0 / self.beta

    # -- the model -------------------------------------------------------
    def time(self, op: str, nbytes: float, world_size: int, num_chunks: int | None = None) -> float:
        """Seconds the ring version of `op` takes on `world_size` ranks for a tensor of `nbytes`
        (`num_chunks`: broadcast's pieces in the pipeline, default N)."""
        a, b = _coefficients(op, world_size, num_chunks)
        return a * self.alpha + b * float(nbytes) * self.beta

    @classmethod
    def fit(cls, sizes: Sequence[float], times: Sequence[float], world_size: int,
            op: str = "all_reduce", num_chunks: int | None = None,
            relative: bool = True) -> "CostModel":
        """Least-squares alpha and beta from measured `times` (s) of `op` on tensors of `sizes` (bytes).

        time = a * alpha + b * size * beta is linear in (alpha, beta): least squares on the columns
        [a, b * size], each scaled to unit norm (alpha ~ 1e-5 and beta ~ 1e-10). `relative` divides
        each row by its time, so timings spanning orders of magnitude all count. Negative estimates
        (noise) are clipped to 0.
        """
        x = np.asarray(sizes, dtype=np.float64)
        y = np.asarray(times, dtype=np.float64)
        if x.ndim != 1 or x.shape != y.shape:
            raise ValueError(f"sizes and times must be 1-D of equal length, got {x.shape} and {y.shape}")
        if len(np.unique(x)) < 2:
            raise ValueError("fit needs at least two different sizes to tell alpha from beta")
        if relative and not np.all(y > 0):
            raise ValueError("a relative fit needs every time to be positive")
        a, b = _coefficients(op, world_size, num_chunks)
        if a == 0 and b == 0:
            raise ValueError(f"{op} on 1 rank sends nothing: there is nothing to fit")
        design = np.stack([np.full_like(x, a), b * x], axis=1)   # (len(sizes), 2)
        if relative:
            design, y = design / y[:, None], np.ones_like(y)
        scale = np.linalg.norm(design, axis=0)
        coef, *_ = np.linalg.lstsq(design / scale, y, rcond=None)
        alpha, beta = (coef / scale).tolist()
        return cls(alpha=max(alpha, 0.0), beta=max(beta, 0.0))
