"""Communication for the course: collectives from scratch, a byte meter, a cost model.

    from reference import comms
    with comms.meter() as m:
        comms.all_reduce(t)       # counted: calls and bytes, per collective and group

* `ring`: collectives built from send/recv (`ring_all_reduce`, `ring_reduce_scatter`,
  `ring_all_gather`, `ring_broadcast`) and the bytes each rank sends in them;
* `algorithms`: all-reduce by other algorithms (binomial tree, recursive halving-doubling,
  hierarchical over nodes) and their time with fast and slow links and NICs per node;
* `collectives`: thin wrappers of torch.distributed's collectives, same signatures, each
  recorded in the open meters with the bytes it sends. Later modules
  communicate only through them, so every byte they move is counted;
* `functional`: collectives as functions of tensors that several parallelisms share,
  `all_gather_along` and the differentiable, uneven `all_to_all`;
* `metering`: `CommMeter` / `meter()`, calls and bytes per collective and process group;
* `cost`: `CostModel`, the alpha-beta model of a collective's time;
* `links`: the link speeds of those models, named once (`NVLINK`, `NIC`, `NICS_PER_NODE`);
* `viz`: pictures of the algorithms' times and of scaling (imported on its own:
  matplotlib stays out of the ranks).
"""

from reference.comms.collectives import (
    ReduceOp, all_gather_into_tensor, all_reduce, all_reduce_coalesced, all_to_all_single,
    all_to_all_waited_by, all_to_all_waiter, broadcast, recv, reduce_scatter, reduce_scatter_tensor, send,
    sum_with_peer,
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

__all__ = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "ring_broadcast",
           "chunk_sizes", "ring_sent_bytes", "CommMeter", "meter", "name_group", "group_label",
           "format_records", "record", "CostModel", "COST_OPS", "tree_all_reduce",
           "halving_doubling_all_reduce", "hierarchical_all_reduce", "node_groups",
           "two_level_time", "Link", "NVLINK", "NIC", "GPUS_PER_NODE", "NICS_PER_NODE",
           "all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
           "all_to_all_single", "send", "recv", "sum_with_peer", "ReduceOp", "all_gather_along", "all_to_all",
           "AllToAll", "all_to_all_waited_by", "all_to_all_waiter"]
