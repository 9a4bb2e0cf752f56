"""ZeRO and FSDP: data parallelism that shards the training state instead of replicating it.

    from reference.zero import ZeroOptimizer, FSDP
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)  # ZeRO-1/2
    model = FSDP(GPT(config))                                                    # ZeRO-3

The three stages of Rajbhandari et al. (2020) keep 1/N per rank of the optimizer state
(stage 1, P_os), the gradients too (stage 2, P_os+g), the parameters as well (stage 3, P_os+g+p).

* `reference.zero.shard`: the flat, padded layout every stage stores parameters in
  (`FlatLayout`) and its buckets (`FlatBucket`);
* `reference.zero.optimizer`: `ZeroOptimizer`, stages 1 and 2, a drop-in
  `torch.optim.Optimizer` (its docstring has the bytes and the memory table);
  `reference.zero.groups`: its weight-decay groups, applied on ranges of its flat shard;
* `reference.zero.reducer`: stage 2's gradients, `BucketReducer`, reduce-scattered bucket
  by bucket during backward;
* `reference.zero.units`: stage 3's one engine, `Unit` (gather, free, reduce-scatter) over a
  layout, flat or per tensor (`reference.zero.rows`: `RowShards`, each tensor cut along dim 0);
  the front-ends below choose units and timing:
* `reference.zero.fsdp`: `FSDP`, one flat unit per block gathered just before it runs (with
  prefetch), mixed precision and CPU offload;
* `reference.zero.fsdp_param`: `ShardedParameters`, each tensor split along dim 0 (FSDP2), the
  stage one unit gathered once a step, which composes with TP, pipelines and checkpointing;
  `ShardedSets` shards experts over their expert-data-parallel group;
* `reference.zero.fsdp_reshard`: `ReshardAfterForward`, the same shards gathered per block and
  micro-batch (FSDP2's ``reshard_after_forward=True``);
* `reference.zero.fully_shard`: `fully_shard`, the same per-tensor shards on any `nn.Module` in
  the shape of PyTorch's FSDP2 (a unit per wrapped module, ``reshard_after_forward``,
  `MixedPrecisionPolicy`, replicated parameters, `full_state_dict`): the optimizer steps on the shards;
* `reference.zero.adam8bit`: `Adam8bit`, AdamW with block-wise 8-bit moments (Dettmers et al.,
  2022): about 2 bytes of state per parameter instead of 8;
* `reference.zero.viz`: what each rank holds at each stage, measured bytes against the formula;
* `reference.zero.widgets`: the memory calculator, an ipywidgets explorer of `reference.memory`.

The formulas (bytes per rank for each stage and precision, `memory.zero_peak_grad_bytes`) and
their measurement (`memory.PeakMemory`) live in `reference.memory`, in the core. Pictures and
widgets are imported from their modules (a rank does not need matplotlib or ipywidgets).
"""
from reference.zero.adam8bit import Adam8bit
from reference.zero.fsdp import FSDP
from reference.zero.fsdp_param import ShardedParameters, ShardedSets
from reference.zero.fsdp_reshard import ReshardAfterForward
from reference.zero.fully_shard import MixedPrecisionPolicy, full_state_dict, fully_shard
from reference.zero.optimizer import ZeroOptimizer
from reference.zero.shard import FlatBucket, FlatLayout, trainable_unique

__all__ = [
    "ZeroOptimizer", "FSDP", "ShardedParameters", "ShardedSets", "ReshardAfterForward", "FlatLayout",
    "FlatBucket", "trainable_unique", "Adam8bit", "fully_shard", "MixedPrecisionPolicy", "full_state_dict",
]
