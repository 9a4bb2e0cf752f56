"""Tree, halving-doubling and hierarchical all-reduce equal dist.all_reduce; their bytes and
steps equal the formulas; the two-link alpha-beta model says where the tree beats the ring."""
import math

import pytest
import torch
import torch.distributed as dist

from reference import comms
from reference.comms.algorithms import (ALGORITHMS, algorithm_steps, halving_doubling_all_reduce,
                                        hierarchical_all_reduce, node_groups, tree_all_reduce,
                                        tree_sent_bytes, two_level_time)
from reference.runtime import launch
from reference.tolerance import gradient

SHAPES = [(12,), (7,), (3, 5)]  # divisible by 2 and 4, and not


def _case(shape, rank):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def _run(kinds, node_size):
    rank, n = dist.get_rank(), dist.get_world_size()
    intra, inter = node_groups(node_size) if node_size else (None, None)
    out = {}
    for kind in kinds:
        for shape in SHAPES:
            x = _case(shape, rank)
            want = x.clone()
            dist.all_reduce(want)
            with comms.meter() as m:
                if kind == "tree":
                    tree_all_reduce(x)
                elif kind == "halving_doubling":
                    halving_doubling_all_reduce(x)
                else:
                    hierarchical_all_reduce(x, intra, inter)
            out[(kind, shape)] = (gradient(n, torch.float64).close(x, want),
                                  m.sent_bytes())
    return out


@pytest.mark.parametrize("world_size, kinds, node_size", [
    (3, ["tree"], 0),
    (4, ["tree", "halving_doubling", "hierarchical"], 2),
])
def test_algorithms_equal_all_reduce_and_send_their_formula(world_size, kinds, node_size):
    """float64 sums of 3-4 numbers in another order: within `gradient(n, torch.float64)`."""
    ranks = launch(_run, world_size, kinds, node_size, timeout=120)
    for (kind, shape), _ in ranks[0].items():
        numel = math.prod(shape)
        S = 8 * numel
        for rank, out in enumerate(ranks):
            ok, sent = out[(kind, shape)]
            assert ok, (kind, shape, rank)
            if kind == "tree":
                assert sent == tree_sent_bytes(S, world_size, rank)
            elif kind == "halving_doubling" and numel % world_size == 0:
                assert sent == 2 * (world_size - 1) * S // world_size
            elif kind == "hierarchical" and numel % world_size == 0:
                g, nodes = node_size, world_size // node_size
                assert sent == 2 * (g - 1) * S // g + 2 * (nodes - 1) * (S // g) // nodes


def test_halving_doubling_refuses_a_group_that_is_not_a_power_of_two():
    def body():
        with pytest.raises(ValueError, match="power-of-two group, got 3 ranks"):
            halving_doubling_all_reduce(torch.ones(4))
        return True
    assert launch(body, 3, timeout=60) == [True] * 3


def test_steps_and_tree_bytes_formulas():
    assert [algorithm_steps("ring", n) for n in (2, 4, 8)] == [2, 6, 14]
    assert [algorithm_steps("tree", n) for n in (2, 3, 4, 8)] == [2, 4, 4, 6]
    assert algorithm_steps("halving_doubling", 8) == 6 and algorithm_steps("hierarchical", 16, 8) == 16
    # up the tree: every rank but 0 sends S once; down: one S per child (rank 0 has log2 N)
    assert [tree_sent_bytes(1, 8, r) for r in range(8)] == [3, 1, 2, 1, 3, 1, 2, 1]


def test_where_the_tree_beats_the_ring():
    """On 1024 ranks, 8 a node: a 1 KB all-reduce is latency-bound (the ring pays 2046
    latencies, 254 of them the NIC's, the tree 20), a 1 GB one bandwidth-bound (the binomial
    tree sends all S in each of its rounds, the ring 2/N of it per step): there the ring, which
    sends the fewest bytes, is the fastest of the four with one NIC a node or one a GPU."""
    small, large = 1e3, 1e9
    assert two_level_time("tree", small, 1024, 8) < two_level_time("ring", small, 1024, 8) / 10
    assert two_level_time("ring", large, 1024, 8) < two_level_time("tree", large, 1024, 8) / 5
    for nics in (1, 8):
        times = {a: two_level_time(a, large, 1024, 8, nics_per_node=nics) for a in ALGORITHMS}
        assert min(times, key=times.get) == "ring"
    # on 8 ranks of one node the ring's few latencies cost little: the tree's edge is small
    assert two_level_time("ring", small, 8, 8) < 3 * two_level_time("tree", small, 8, 8)


def test_nics_per_node():
    """One NIC per node: the ring is the single ring through it, 2 (N-1) (alpha + S/N / NIC);
    one NIC per GPU (the default): NCCL's parallel rings, one per NIC, so the ring's
    bandwidth term is min(NVLink, 8 NICs). The hierarchical all-reduce sends the same bytes
    across nodes as the ring (2 (nodes-1)/nodes S against 2 (n-1)/n S) whatever the NICs, plus
    its passes inside the node: it gains latencies, not bandwidth."""
    from reference.comms.links import NIC, NICS_PER_NODE, NVLINK
    S, n, g = 1e9, 64, 8
    assert NICS_PER_NODE == g and (NVLINK.bandwidth, NIC.bandwidth) == (450e9, 50e9)
    # NCCL's model: only the 2 (nodes-1) steps that cross a node pay the NIC's latency
    latency = 2 * (n // g - 1) * NIC.alpha + 2 * (n - n // g) * NVLINK.alpha
    assert two_level_time("ring", 0, n, g) == pytest.approx(latency)
    one = two_level_time("ring", S, n, g, nics_per_node=1)
    assert one == pytest.approx(latency + 2 * (n - 1) * S / n / NIC.bandwidth)
    every = two_level_time("ring", S, n, g)
    assert every == pytest.approx(latency + 2 * (n - 1) * S / n / min(NVLINK.bandwidth, g * NIC.bandwidth))
    assert two_level_time("ring", S, n, g, nics_per_node=g) == every and one > 7 * every / 2
    no_latency = dict(intra=(0.0, NVLINK.bandwidth), inter=(0.0, NIC.bandwidth))
    for nics in (1, 2, 8):
        ring = two_level_time("ring", S, n, g, nics_per_node=nics, **no_latency)
        hier = two_level_time("hierarchical", S, n, g, nics_per_node=nics, **no_latency)
        ring_across = two_level_time("ring", S, n, g, nics_per_node=nics,
                                     intra=(0.0, float("inf")), inter=(0.0, NIC.bandwidth))
        assert ring_across == pytest.approx(2 * (n - 1) / n * S / (min(nics, g) * NIC.bandwidth))
        assert ring < 1.05 * hier if nics == 1 else ring < hier   # within 5 %, or the ring ahead
        across = two_level_time("hierarchical", S, n, g, nics_per_node=nics,
                                intra=(0.0, float("inf")), inter=(0.0, NIC.bandwidth))
        assert across == pytest.approx(2 * (n // g - 1) / (n // g) * S / (min(nics, g) * NIC.bandwidth))
    # halving-doubling takes its nearest partners first: with free links inside a node, what
    # is left is halving-doubling across the nodes on the S/g each GPU holds by then
    free = (0.0, float("inf"))
    assert two_level_time("halving_doubling", S, n, g, intra=free) == pytest.approx(
        two_level_time("halving_doubling", S / g, n // g, 1))
    # large messages on 8 nodes with a NIC per GPU: the ring is fastest; latency-bound ones: not
    big = {a: two_level_time(a, 200 * 2**20, n, g) for a in ("ring", "tree", "halving_doubling", "hierarchical")}
    assert min(big, key=big.get) == "ring"
    with pytest.raises(ValueError, match="nics_per_node must be at least 1"):
        two_level_time("ring", S, n, g, nics_per_node=0)
