"""Context parallelism: long sequences split over the ranks of a cp group.

    from reference.context_parallel import ring_attention, ulysses_attention, split_sequence
    q_r, k_r, v_r = (split_sequence(t, cp, cp_rank, dim=2) for t in (q, k, v))  # (B, H, T/cp, D)
    out_r = ring_attention(q_r, k_r, v_r, cp_group)          # or ulysses_attention(...)

Activations grow with the sequence length T, attention's scores with T^2. Context parallelism
gives each of the cp ranks T/cp of the tokens. Everything but attention acts token by token; in
attention every query must meet every earlier key, so the ranks exchange either keys and values
(ring attention) or heads (Ulysses).

* `layout`: which tokens a rank holds, the contiguous and the zig-zag split (chunks r
  and 2 cp - 1 - r, the same causal work on every rank);
* `blocks`: one ring step on one rank: which query and key rows meet, blockwise
  attention with its log-sum-exp, the online-softmax merge, the FlashAttention-2 backward;
* `ring`: `ring_attention` (Liu et al., 2023), key/value blocks round the ring;
* `ulysses`: `ulysses_attention` (DeepSpeed-Ulysses, Jacobs et al., 2023), an
  all-to-all from a sequence split to a head split and back;
* `attention`, `gpt`: the course's attention module and a whole GPT on this rank's tokens;
* `apply`: context parallelism as one dimension of the composed GPT (`apply_context_parallel_dim`,
  `context_parallel_batch`), what `reference.parallel.parallelize` and `train_step` call;
* `cost`, `measure`: bytes, memory and work per rank as formulas, and the meters of memory;
* `viz`: notebook 08's pictures (imported on its own: matplotlib stays out of the ranks).

Ring attention holds one (T/cp)^2 score block per head and runs on any cp; Ulysses sends less
as cp grows but needs cp to divide the heads and holds (T, T) scores per local head.
"""
from reference.context_parallel.apply import (
    ContextParallelPositions, apply_context_parallel_dim, context_parallel_batch,
)
from reference.context_parallel.attention import KINDS, ContextParallelAttention
from reference.context_parallel.blocks import BlockPlan, attend_block, attend_block_backward, block_plan, merge_block
from reference.context_parallel.cost import (
    causal_pairs_per_rank, ring_attention_saved_bytes, ring_attention_sent_bytes,
    ring_block_elements_per_rank, ring_pairs_per_rank, score_block_elements, ulysses_sent_bytes,
)
from reference.context_parallel.gpt import (
    ContextParallelGPT, allreduce_context_parallel_grads, apply_context_parallel,
)
from reference.context_parallel.layout import (
    check_sequence_split, gather_order, gather_sequence, sequence_positions, split_sequence,
    zigzag_chunks,
)
from reference.context_parallel.measure import LargestTensor, SavedTensorBytes
from reference.context_parallel.ring import ring_attention
from reference.context_parallel.ulysses import (
    check_heads, heads_to_sequence, sequence_to_heads, ulysses_attention,
)

__all__ = ["split_sequence", "gather_sequence", "sequence_positions", "gather_order",
           "check_sequence_split", "zigzag_chunks", "ring_attention", "BlockPlan", "block_plan",
           "attend_block", "merge_block", "attend_block_backward", "ulysses_attention",
           "sequence_to_heads", "heads_to_sequence", "check_heads", "ContextParallelAttention",
           "KINDS", "ContextParallelGPT", "apply_context_parallel",
           "allreduce_context_parallel_grads", "ring_attention_sent_bytes", "ulysses_sent_bytes",
           "ring_attention_saved_bytes", "score_block_elements", "causal_pairs_per_rank",
           "ring_pairs_per_rank", "ring_block_elements_per_rank", "SavedTensorBytes",
           "LargestTensor", "ContextParallelPositions", "apply_context_parallel_dim",
           "context_parallel_batch"]
