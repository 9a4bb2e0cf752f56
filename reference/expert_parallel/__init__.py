"""Expert parallelism: a mixture of experts, its experts spread over the ranks.

    from reference.expert_parallel import MoE, ExpertParallelMoE, moe_factory
    dense = GPT(config, ffn_factory=moe_factory(n_experts=8, k=2))   # one process
    layer = ExpertParallelMoE.from_dense(moe, mesh.ep_group)          # E / ep experts per rank

* `router`: the gate (softmax: Switch, GShard; sigmoid: DeepSeek-V3), top-k routing (Switch
  k = 1, GShard k = 2), capacity and dropping, the load-balancing (sequence-wise) and z losses,
  the dispatch plan (`sort_by_expert`, `combine`);
* `moe`: `MoE`, the single-process oracle, and `ExpertParallelMoE`, which sends each token to the
  rank holding its expert and back; `moe_all_reduce_gradients` for data parallelism;
* `bias_balance`: balancing by a per-expert bias instead of a loss (loss-free balancing, DeepSeek-V3,
  `update_expert_bias`);
* `comms`: the counts exchanged before the all-to-all, and the bytes it moves per step;
* `sequence_parallel`: MoE layers under Megatron sequence parallelism (`sequence_parallel_experts`);
* `viz`: loads, routes, the all-to-all drawn from real routes, memory per rank, the gate, balance.

With E experts on P ranks each rank stores E / P of the expert weights (the article's 1/8 at 8 ranks).
"""
from reference.expert_parallel.bias_balance import biased_routers, register_bias_update, update_expert_bias
from reference.expert_parallel.comms import all_to_all_bytes_per_step, exchange_counts
from reference.expert_parallel.moe import (
    Expert, ExpertParallelMoE, MoE, MoEStats, expert_parameters, moe_all_reduce_gradients,
    moe_factory, shard_experts,
)
from reference.expert_parallel.router import (
    DispatchPlan, Router, Routing, combine, expert_capacity, sort_by_expert,
)

__all__ = [
    "Expert", "MoEStats", "MoE", "ExpertParallelMoE", "moe_factory", "shard_experts",
    "expert_parameters", "moe_all_reduce_gradients",
    "Router", "Routing", "DispatchPlan", "expert_capacity", "sort_by_expert", "combine",
    "exchange_counts", "all_to_all_bytes_per_step",
    "biased_routers", "update_expert_bias", "register_bias_update",
]
