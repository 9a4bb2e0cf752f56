"""Tensor parallelism (Megatron-LM) and sequence parallelism for the course's GPT.

    from reference.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy
    model = apply_tensor_parallel(GPT(config), mesh, sequence_parallel=True)  # inside a rank

The modules, all importable from here:

* `comms`: Megatron's conjugate operators f and g, gather/scatter along the hidden and the sequence dim;
* `layers`: `ColumnParallelLinear`, `RowParallelLinear`;
* `cut`: `TensorParallelCut`, how a layer cut each parameter, recorded on it (``p.tp_cut``);
* `attention`: `ParallelCausalSelfAttention` (heads split);
* `loss`: `VocabParallelEmbedding`, `vocab_parallel_cross_entropy`;
* `rng`: dropout seeds for shards and replicas;
* `plan`: `apply_tensor_parallel`, `TP_PLAN`, `SP_PLAN`;
* `viz`: the split GEMM and activation memory, drawn.

Communication per transformer block (S = B * T * C * element bytes, the size of
one activation; N = tp). "payload" is the size of the tensor each collective
reduces or produces, "sent" what each rank sends on a ring, as
`reference.comms` records them:

    without SP  forward   2 all-reduce     payload 2 S   sent 2 * 2 (N-1)/N S
                backward  2 all-reduce     payload 2 S   sent 2 * 2 (N-1)/N S
    with SP     forward   2 all-gather  +  2 reduce-scatter, payload S each,
                          sent 4 * (N-1)/N S: the same bytes as without SP
                backward  2 reduce-scatter + 2 all-gather, the same
    with SP and regather_input=True: backward has 2 more all-gathers (payload S
                each), to gather again the inputs of c_attn and c_fc that
                forward did not keep.

One all-reduce pair per layer pair: the attention (c_attn column, c_proj row) and the MLP
(c_fc column, c_proj row). Under SP the parameters that see only this rank's tokens (ln_1,
ln_2 and the two row-parallel biases: 6 C numbers per block; ln_f once) need their gradients
summed over the TP group after backward, in one all-reduce (`allreduce_sequence_parallel_grads`).
Forgetting it is silent: each rank keeps a different, partial gradient. Outside the blocks:
the embedding's g (an all-reduce of S forward), the output layer's f (an all-reduce of S
backward; under SP an all-gather forward, a reduce-scatter backward) and the loss's three
all-reduces of B * T floats (`loss`).
"""

from reference.tensor_parallel.attention import ParallelCausalSelfAttention
from reference.tensor_parallel.comms import (
    copy_to_tensor_parallel_region, f, g, gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from reference.tensor_parallel.cut import TensorParallelCut
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, column_shard, row_shard
from reference.tensor_parallel.loss import (
    VocabParallelEmbedding, padded_vocab_size, vocab_parallel_cross_entropy,
)
from reference.tensor_parallel.plan import (
    SP_PLAN, TP_PLAN, SequenceParallelScatter, allreduce_sequence_parallel_grads,
    apply_tensor_parallel,
)
from reference.tensor_parallel.rng import ShardedDropout, TensorParallelRNG

__all__ = [
    "apply_tensor_parallel", "allreduce_sequence_parallel_grads", "TP_PLAN", "SP_PLAN", "ColumnParallelLinear",
    "RowParallelLinear", "ParallelCausalSelfAttention", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "padded_vocab_size", "TensorParallelRNG", "ShardedDropout", "SequenceParallelScatter", "column_shard",
    "row_shard", "TensorParallelCut", "f", "g", "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "gather_from_tensor_parallel_region", "scatter_to_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]
