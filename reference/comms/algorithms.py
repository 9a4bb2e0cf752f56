"""All-reduce algorithms other than the ring, from send/recv: tree, halving-doubling, hierarchical.

All four sum a tensor of S bytes over N ranks; they differ in how many steps (each paying a
latency alpha) and how many bytes (each paying 1 / bandwidth beta) a rank needs:

    algorithm                steps            bytes a rank sends (S divisible)
    ring                     2 (N - 1)        2 (N - 1) / N * S
    binomial tree            2 ceil(log2 N)   S up the tree (N - 1 ranks), S per child down it
    halving-doubling         2 log2 N         2 (N - 1) / N * S            (N a power of two)
    hierarchical (g / node)  2 (g - 1) + 2 (n - 1)   2 (g-1)/g S inside + 2 (n-1)/n S/g across

* the **ring** (`reference.comms.ring`) moves the fewest bytes but pays N - 1 latencies twice:
  best for large messages;
* the **binomial tree** reduces to rank 0 in ceil(log2 N) rounds (in round k ranks with bit k
  set send their partial sum to the rank 2^k below and drop out) and broadcasts back the same
  way: log N latencies, but whole-tensor messages, best for small messages on many ranks. NCCL's
  *double* binary tree sends each half of the tensor through one of two trees, every rank a leaf
  in one and an inner node in the other, and matches the ring's bandwidth; a single one is easier
  to follow;
* **recursive halving-doubling** (Rabenseifner): reduce-scatter by exchanging halves with the
  partner at distance 1, 2, 4, ..., N/2 (nearest first: with nodes of consecutive ranks the
  large halves stay inside a node), then all-gather the same way back;
* **hierarchical**: with nodes of g consecutive ranks (fast links inside, slow across),
  reduce-scatter inside each node, all-reduce each 1/g piece across the nodes, all-gather
  inside: only S / g per rank crosses the slow links.

`two_level_time` prices each with two link classes (`reference.comms.links`) and NICs per node.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from reference.comms.links import NIC, NVLINK
from reference.comms.metering import record
from reference.comms.ring import exchange, ring_all_gather, ring_all_reduce, ring_reduce_scatter

__all__ = ["tree_all_reduce", "halving_doubling_all_reduce", "hierarchical_all_reduce",
           "node_groups", "tree_sent_bytes", "algorithm_steps", "two_level_time", "ALGORITHMS"]

ALGORITHMS = ("ring", "tree", "halving_doubling", "hierarchical")


def _place(group):
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return ranks, dist.get_rank(group), len(ranks)


def tree_sent_bytes(nbytes: int, world_size: int, rank: int) -> int:
    """Bytes group rank ``rank`` sends in `tree_all_reduce`: S up to its parent (all but
    rank 0), then S to each of its children on the way down."""
    children = sum(1 for k in range(max(1, math.ceil(math.log2(world_size))))
                   if rank % (2 << k) == 0 and rank + (1 << k) < world_size)
    return (nbytes if rank else 0) + children * nbytes


def tree_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group`` with a binomial tree: reduce to rank 0, broadcast
    back. 2 ceil(log2 N) rounds; any N."""
    ranks, me, n = _place(group)
    flat = tensor.detach().reshape(-1)  # (numel,): a view, or a copy when tensor is not contiguous
    rounds = math.ceil(math.log2(n)) if n > 1 else 0
    sent, incoming = 0, torch.empty_like(flat)
    for k in range(rounds):  # up: in round k the ranks with bit k set hand their sum down
        mask = 1 << k
        if me % (2 * mask) == mask:
            sent += exchange(group, send=flat, dst=ranks[me - mask])
        elif me % (2 * mask) == 0 and me + mask < n:
            exchange(group, recv=incoming, src=ranks[me + mask])
            flat.add_(incoming)
    for k in reversed(range(rounds)):  # down: the same edges, the other way
        mask = 1 << k
        if me % (2 * mask) == 0 and me + mask < n:
            sent += exchange(group, send=flat, dst=ranks[me + mask])
        elif me % (2 * mask) == mask:
            exchange(group, recv=flat, src=ranks[me - mask])
    if not tensor.is_contiguous():
        tensor.detach().copy_(flat.view(tensor.shape))
    record("tree_all_reduce", group, tensor.numel() * tensor.element_size(), sent)
    return tensor


def halving_doubling_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group`` (N a power of two) by recursive halving
    (reduce-scatter) then recursive doubling (all-gather): 2 log2 N steps, the ring's bytes."""
    ranks, me, n = _place(group)
    if n & (n - 1):
        raise ValueError(f"recursive halving-doubling needs a power-of-two group, got {n} ranks "
                         f"(world_size={dist.get_world_size()}): use the ring or the tree")
    flat = tensor.detach().reshape(-1)  # (numel,): a view, or a copy when tensor is not contiguous
    lo, hi, sent, kept = 0, flat.numel(), 0, []
    distance = 1
    while distance < n:  # halving, nearest partner first: keep one half, send the other
        partner, mid = ranks[me ^ distance], lo + (hi - lo) // 2
        mine, theirs = (slice(lo, mid), slice(mid, hi)) if me < me ^ distance else (slice(mid, hi), slice(lo, mid))
        incoming = torch.empty_like(flat[mine])
        sent += exchange(group, flat[theirs], partner, incoming, partner)
        flat[mine].add_(incoming)
        kept.append((mine, theirs, partner))
        lo, hi = mine.start, mine.stop
        distance *= 2
    for mine, theirs, partner in reversed(kept):  # doubling: give back, take the rest
        sent += exchange(group, flat[mine].clone(), partner, flat[theirs], partner)
    if not tensor.is_contiguous():
        tensor.detach().copy_(flat.view(tensor.shape))
    record("halving_doubling_all_reduce", group, tensor.numel() * tensor.element_size(), sent)
    return tensor


def node_groups(node_size: int):
    """(intra, inter) process groups of this rank when the world is cut into nodes of
    ``node_size`` consecutive ranks. Collective: every rank calls it, in the same order."""
    world, me = dist.get_world_size(), dist.get_rank()
    if node_size < 1 or world % node_size:
        raise ValueError(f"node_size={node_size} must divide world_size={world}")
    intra = inter = None
    for node in range(world // node_size):
        ranks = list(range(node * node_size, (node + 1) * node_size))
        group = dist.new_group(ranks)
        if me in ranks:
            intra = group
    for local in range(node_size):
        ranks = list(range(local, world, node_size))
        group = dist.new_group(ranks)
        if me in ranks:
            inter = group
    return intra, inter


def hierarchical_all_reduce(tensor: torch.Tensor, intra, inter) -> torch.Tensor:
    """Sum ``tensor`` in place: ring reduce-scatter inside the node, ring all-reduce of this
    rank's piece across the nodes, ring all-gather inside the node (`node_groups`)."""
    flat = tensor.detach().reshape(-1)
    piece = ring_reduce_scatter(flat, group=intra)          # (numel / g,) summed over the node
    ring_all_reduce(piece, group=inter)                     # summed over every node
    whole = ring_all_gather(piece, group=intra, numel=flat.numel())
    tensor.detach().copy_(whole.view(tensor.shape))
    return tensor


def algorithm_steps(algorithm: str, n: int, node_size: int = 1) -> int:
    """Communication steps (rounds of messages) of each algorithm on n ranks."""
    if algorithm == "ring":
        return 2 * (n - 1)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) if n > 1 else 0
    if algorithm == "halving_doubling":
        return 2 * int(math.log2(n))
    if algorithm == "hierarchical":
        return 2 * (node_size - 1) + 2 * (n // node_size - 1)
    raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")


def _nic_share(nics: int, transfers: int) -> float:
    """The share of one NIC's bandwidth each of `transfers` transfers leaving a node of `nics` NICs gets."""
    return min(1.0, nics / transfers) if transfers else 1.0


def two_level_time(algorithm: str, nbytes: float, n: int, node_size: int,
                   intra=NVLINK, inter=NIC, nics_per_node: int | None = None) -> float:
    """Seconds of one all-reduce of ``nbytes`` on ``n`` ranks, ``node_size`` a node, in the
    alpha-beta model with two `reference.comms.links` ``(alpha, bandwidth)``: ``intra`` (GPU to
    GPU inside a node) and ``inter`` (one NIC to another node). A node has ``nics_per_node`` NICs
    (default one per GPU); k transfers leaving a node through m NICs each get min(1, m / k) of one.

    * ring: as NCCL, ``nics_per_node`` parallel rings (channels), each with 1/nics of the data and
      a NIC of its own; a step is as slow as its slowest link, max(S/n over NVLink, S/(n nics)
      over one NIC). It pays the NIC's latency on its 2 (nodes-1) steps across nodes and
      NVLink's on the 2 (n - nodes) others (NCCL's tuning model, its nInterSteps);
    * tree: its cross-node rounds send the whole tensor from one GPU, through one NIC;
    * halving-doubling: only the last log2(nodes) steps, with S/g and less, cross the nodes, all
      ``node_size`` GPUs of a node sending at once;
    * hierarchical: ``node_size`` rings cross the nodes at once, each with S / node_size bytes.
      It sends 2 (nodes-1)/nodes S out of each node against the ring's 2 (n-1)/n S, through the
      same NICs, and adds passes inside the node: it saves latencies (2 (g-1) + 2 (nodes-1)
      steps instead of 2 (n-1)), not bandwidth."""
    a_in, b_in = intra
    a_out, b_out = inter
    nodes = n // node_size
    nics = node_size if nics_per_node is None else int(nics_per_node)
    if nics < 1:
        raise ValueError(f"nics_per_node must be at least 1, got {nics_per_node}")
    if algorithm == "ring":
        inter_steps = 2 * (nodes - 1)
        per_step = max(nbytes / n / b_in, nbytes / n / nics / b_out) if nodes > 1 else nbytes / n / b_in
        return inter_steps * a_out + (2 * (n - 1) - inter_steps) * a_in + 2 * (n - 1) * per_step
    if algorithm == "tree":
        rounds = math.ceil(math.log2(n)) if n > 1 else 0
        return sum(2 * ((a_in + nbytes / b_in) if (1 << k) < node_size else (a_out + nbytes / b_out))
                   for k in range(rounds))
    if algorithm == "halving_doubling":
        across_bw = b_out * _nic_share(nics, node_size)
        return sum(2 * ((a_in + nbytes / (2 << k) / b_in) if (1 << k) < node_size
                        else (a_out + nbytes / (2 << k) / across_bw))
                   for k in range(int(math.log2(n))))
    if algorithm == "hierarchical":
        g = node_size
        inside = 2 * (g - 1) * (a_in + nbytes / g / b_in) if g > 1 else 0.0
        across_bw = b_out * _nic_share(nics, g)
        across = 2 * (nodes - 1) * (a_out + nbytes / g / nodes / across_bw) if nodes > 1 else 0.0
        return inside + across
    raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
