"""Topology-aware placement: which ranks share a node decides which bytes cross the slow links.

The mesh (`reference.mesh`) numbers ranks Megatron's way, TP innermost:
``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``, so with 8 GPUs a node and tp = 8 TP, which
communicates inside every layer, never leaves NVLink. `group_ranks` builds the groups for any
order of the axes, `crossing_fraction` counts a group's ring edges that join two nodes, and
`placement_costs` prices each kind of traffic of a step (`reference.parallel.estimate`) on the
slow link when any edge of its ring crosses (a ring is as slow as its slowest link)."""
from __future__ import annotations

import itertools

from reference.parallel.config import ParallelConfig
from reference.parallel.estimate import estimate

__all__ = ["MEGATRON_ORDER", "group_ranks", "crossing_fraction", "placement_costs"]

MEGATRON_ORDER = ("tp", "dp", "pp")  # innermost first


def group_ranks(order, dp: int, tp: int, pp: int, dim: str) -> list[list[int]]:
    """The groups of dimension ``dim`` when ranks are numbered with ``order`` (innermost axis
    first): the ranks that differ in ``dim``'s coordinate only."""
    sizes = {"dp": dp, "tp": tp, "pp": pp}
    if sorted(order) != ["dp", "pp", "tp"] or dim not in sizes:
        raise ValueError(f"order must be a permutation of ('tp', 'dp', 'pp'), got {order!r}; dim {dim!r}")

    def rank(coords):
        r, stride = 0, 1
        for axis in order:
            r += coords[axis] * stride
            stride *= sizes[axis]
        return r

    others = [a for a in order if a != dim]
    groups = []
    for fixed in itertools.product(*(range(sizes[a]) for a in others)):
        coords = dict(zip(others, fixed))
        groups.append([rank({**coords, dim: i}) for i in range(sizes[dim])])
    return sorted(groups)


def crossing_fraction(groups, gpus_per_node: int) -> float:
    """Share of ring edges (member i to member i + 1, the last back to the first) that join
    ranks of different nodes."""
    edges = crossing = 0
    for g in groups:
        if len(g) < 2:
            continue
        for a, b in zip(g, g[1:] + g[:1]):
            edges += 1
            crossing += a // gpus_per_node != b // gpus_per_node
    return crossing / edges if edges else 0.0


def placement_costs(model, config: ParallelConfig, order=MEGATRON_ORDER, gpus_per_node: int = 8,
                    intra_bandwidth: float = 300e9, inter_bandwidth: float = 25e9, **estimate_kwargs) -> dict:
    """Per GPU and step: {kind: (bytes, share of its ring edges that cross nodes, seconds)} and
    "slow_bytes", "seconds" totals. Bandwidths in bytes/s (NVLink-like and InfiniBand-like)."""
    sent = estimate(model, config, **estimate_kwargs).bytes_per_step
    out, slow, seconds = {}, 0.0, 0.0
    for kind, nbytes in sent.items():
        frac = crossing_fraction(group_ranks(order, config.dp, config.tp, config.pp, kind), gpus_per_node)
        t = nbytes / (inter_bandwidth if frac > 0 else intra_bandwidth)
        out[kind] = (nbytes, frac, t)
        slow += nbytes if frac > 0 else 0.0
        seconds += t
    out["slow_bytes"], out["seconds"] = slow, seconds
    return out
