"""Context parallelism: long sequences split over the ranks of a cp group.

    from reference.context_parallel import ring_attention, ulysses_attention, split_sequence
    q_r, k_r, v_r = (split_sequence(t, cp, cp_rank, dim=2) for t in (q, k, v))  # (B, H, T/cp, D)
    out_r = ring_attention(q_r, k_r, v_r, cp_group)          # or ulysses_attention(...)

Activations grow with the sequence length T and attention's scores with T^2.
Data, tensor and pipeline parallelism leave every rank with the whole sequence;
context parallelism gives each of the cp ranks T/cp of its tokens. Everything
but attention acts token by token and runs unchanged on a rank's tokens; in
attention every query must meet every earlier key, so the ranks exchange either
keys and values (ring attention) or heads (Ulysses).

Where each part lives:

* `reference.context_parallel.layout`: which tokens a rank holds, the contiguous
  and the zig-zag split (chunks r and 2 cp - 1 - r, the same causal work on every
  rank): `split_sequence`, `gather_sequence`, `sequence_positions`;
* `reference.context_parallel.blocks`: one ring step on one rank: which query and
  key rows meet (`block_plan`), blockwise attention with its log-sum-exp, the
  online-softmax merge, and the FlashAttention-2 backward of a block;
* `reference.context_parallel.ring`: `ring_attention` (Liu et al., 2023): the
  key/value blocks go round the ring with send/recv overlapped with compute; the
  backward sends the blocks again with their gradient accumulators;
* `reference.context_parallel.ulysses`: `ulysses_attention` (DeepSpeed-Ulysses,
  Jacobs et al., 2023): all-to-all from a sequence split to a head split, dense
  attention on H/cp heads, all-to-all back;
* `reference.context_parallel.attention`: `ContextParallelAttention.from_dense`,
  the course's attention module on this rank's tokens;
* `reference.context_parallel.gpt`: `ContextParallelGPT`, a whole GPT on this
  rank's tokens with their true position ids, its loss share, and the gradient
  sum over cp;
* `reference.context_parallel.cost`: bytes per rank, saved memory, the largest
  block, and the causal work per rank, as formulas;
* `reference.context_parallel.measure`: `SavedTensorBytes` and `LargestTensor`,
  the meters that check the memory formulas;
* `reference.context_parallel.viz`: notebook 08's pictures: memory against T, the
  ring drawn from its messages, causal work per rank, bytes of ring and Ulysses.

Per rank, forward and backward of one attention (S = B H (T/cp) D bytes, the size
of this rank's q)::

                 sent                          largest score tensor   limit
    ring         2 (cp-1) S fwd, 4 (cp-1) S bwd  (T/cp)^2 per head      any cp (T % 2cp == 0)
    Ulysses      4 (cp-1)/cp S fwd, same bwd     T^2 per local head     cp divides H

(the ring's backward blocks are half K, V and half float32 dK, dV: over a bf16 training step
the ring sends cp times Ulysses' bytes. With grouped-query attention the ring's blocks and
Ulysses' k, v all-to-alls carry H_kv heads, Ulysses' q and output all-to-alls still H:
`reference.context_parallel.cost`.)
"""
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
from reference.context_parallel import viz
from reference.context_parallel.ring import ring_attention
from reference.context_parallel.ulysses import (
    check_heads, heads_to_sequence, sequence_to_heads, ulysses_attention,
)

__all__ = [
    # the layout of the sequence
    "split_sequence", "gather_sequence", "sequence_positions", "gather_order",
    "check_sequence_split", "zigzag_chunks",
    # ring attention
    "ring_attention", "BlockPlan", "block_plan", "attend_block", "merge_block", "attend_block_backward",
    # Ulysses
    "ulysses_attention", "sequence_to_heads", "heads_to_sequence", "check_heads",
    # the model
    "ContextParallelAttention", "KINDS", "ContextParallelGPT", "apply_context_parallel",
    "allreduce_context_parallel_grads",
    # costs and their meters
    "ring_attention_sent_bytes", "ulysses_sent_bytes", "ring_attention_saved_bytes",
    "score_block_elements", "causal_pairs_per_rank", "ring_pairs_per_rank",
    "ring_block_elements_per_rank", "SavedTensorBytes", "LargestTensor",
    # pictures
    "viz",
]
