"""The link speeds the course's cost models use, named and defined once.

Orders of magnitude of a current GPU node (an H100 SXM node of 8 GPUs), for arithmetic,
not measurements of any one machine:

    NVLINK   inside a node: 450 GB/s per GPU each way (NVLink 4: 18 links x 25 GB/s),
             a step's latency about 1 us
    NIC      across nodes: 50 GB/s per NIC each way (InfiniBand NDR, 400 Gb/s), about 5 us;
             a current node has one such NIC per GPU (NICS_PER_NODE = 8)

A `Link` holds the alpha-beta model's two numbers; `two_level_time` and notebooks 07 and 08
read them from here.
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Link", "NVLINK", "NIC", "GPUS_PER_NODE", "NICS_PER_NODE"]


class Link(NamedTuple):
    """One class of link: ``alpha`` seconds per message, ``bandwidth`` bytes per second one way."""

    alpha: float
    bandwidth: float

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth


NVLINK = Link(alpha=1e-6, bandwidth=450e9)   # GPU to GPU inside a node
NIC = Link(alpha=5e-6, bandwidth=50e9)       # one network card to another node
GPUS_PER_NODE = 8
NICS_PER_NODE = 8                            # one NIC per GPU, as on current training nodes
