"""Communication for the course: collectives from scratch, a byte meter, a cost model.

Everything the rest of the course needs to communicate is reachable from here:

    from reference import comms
    with comms.meter() as m:
        comms.all_reduce(t)       # counted: calls and bytes, per collective and group


* ring collectives built from send/recv (`ring_all_reduce`, `ring_reduce_scatter`,
  `ring_all_gather`, `ring_broadcast`), in `reference.comms.ring`;
* `CommMeter` / `meter()`, which counts calls and bytes per collective and per
  process group, and `name_group`, in `reference.comms.metering`;
* `CostModel`, the alpha-beta model of a collective's time, in `reference.comms.cost`;
* all-reduce by other algorithms (binomial tree, recursive halving-doubling, hierarchical
  over nodes) and their time with fast and slow links and a number of NICs per node, in
  `reference.comms.algorithms`;
* the link speeds of those models, named once (`NVLINK`, `NIC`, `NICS_PER_NODE`), in
  `reference.comms.links`; pictures of the algorithms' times and of scaling in
  `reference.comms.viz` (imported on its own: matplotlib stays out of the ranks);
* collectives as functions of tensors that several parallelisms share, in
  `reference.comms.functional`: `all_gather_along` (one dimension, rank order) and
  `all_to_all` (uneven splits, differentiable: its backward is the inverse exchange);
* in `reference.comms.collectives`, thin wrappers of torch.distributed's collectives with the same
  signatures. Each records its call in the open meters and then calls
  torch.distributed. Later modules communicate only through these wrappers, so
  every byte they move is counted.

Bytes recorded by the wrappers. S is the `payload_bytes` of the call: the whole
tensor the collective reduces or produces (for all-gather the output, for
reduce-scatter the input, otherwise the tensor handed to the op). `sent_bytes` is
what this rank would send in the ring algorithm of `reference.comms.ring`; torch
(gloo, NCCL) may choose another algorithm, but the ring's count is the one the
course's formulas teach:

    all_reduce              2(N-1)/N * S   (exactly, per rank, when S divides by N)
    reduce_scatter_tensor    (N-1)/N * S
    all_gather_into_tensor   (N-1)/N * S
    all_to_all_single       the bytes of the rows sent to the other ranks (exact,
                            from the split sizes; the rows kept by this rank are free)
    broadcast               S on every rank except the rank just before src on the
                            ring (the end of the pipelined chain), which sends 0
    send / recv             S / 0
"""

from reference.comms.collectives import (
    ReduceOp, all_gather_into_tensor, all_reduce, all_to_all_single, broadcast, recv,
    reduce_scatter_tensor, send,
)
from reference.comms.algorithms import (
    halving_doubling_all_reduce, hierarchical_all_reduce, node_groups, tree_all_reduce, two_level_time,
)
from reference.comms.cost import COST_OPS, CostModel
from reference.comms.functional import AllToAll, all_gather_along, all_to_all
from reference.comms.links import GPUS_PER_NODE, NIC, NICS_PER_NODE, NVLINK, Link
from reference.comms.metering import CommMeter, format_records, group_label, meter, name_group, record
from reference.comms.ring import (
    chunk_sizes, ring_all_gather, ring_all_reduce, ring_broadcast, ring_reduce_scatter,
    ring_sent_bytes,
)

__all__ = [
    # from-scratch ring collectives
    "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "ring_broadcast",
    "chunk_sizes", "ring_sent_bytes",
    # the meter
    "CommMeter", "meter", "name_group", "group_label", "format_records", "record",
    # the cost model
    "CostModel", "COST_OPS",
    # other all-reduce algorithms
    "tree_all_reduce", "halving_doubling_all_reduce", "hierarchical_all_reduce", "node_groups",
    "two_level_time",
    # link speeds
    "Link", "NVLINK", "NIC", "GPUS_PER_NODE", "NICS_PER_NODE",
    # metered wrappers of torch.distributed
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
    "all_to_all_single", "send", "recv", "ReduceOp",
    # collectives as functions of tensors
    "all_gather_along", "all_to_all", "AllToAll",
]
