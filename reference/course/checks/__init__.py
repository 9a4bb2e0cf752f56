"""Visible self-checks for the homework notebooks: feedback while you work, never the grade.

    from reference.course.checks import check_ring_all_reduce
    check_ring_all_reduce(ring_all_reduce)     # prints one PASS or FAIL line, with a hint

Each check runs the student's function on a few ranks (`reference.runtime.launch`)
under the same rules as the hidden checks (the collectives an exercise must build
are switched off), compares it with the course's answer on public inputs, and
prints one line; a wrong answer, an exception or a hang is reported, never raised.
While grading, `skip=True` is passed and the check does nothing.

`reference.course.checks.runner` is the one runner they share (launch the ranks,
describe a failed launch, pick the hint, print the line, never raise); each module
below holds only its homework's hints and words, one per homework notebook:

* `collectives` (00): ring all-reduce and all-gather, tree and recursive-doubling
  all-reduce from send/recv, the crossover message size;
* `data_parallel` (01): averaged and bucketed gradient all-reduce, accumulation over
  unequal local batches, an int8 all-reduce with error feedback, bytes per step;
* `zero` (02): a ZeRO-1 optimizer, gradient clipping over shards, an FSDP prefetch
  schedule, a graded number;
* `tensor_parallel` (03): the TP MLP with f and g, vocab-parallel cross-entropy, sequence
  parallelism with uneven shards, TP dropout, a graded number;
* `pipeline_parallel` (04): GPipe, 1F1B and interleaved 1F1B as action lists, stages
  balanced by time within a memory budget, a graded number;
* `expert_parallel` (05): top-k routing with capacity, dispatch and combine, the
  deduplicated dispatch, the balance loss over every rank, a graded number, the bias that
  balances without a loss (DeepSeek-V3) moved by a step's whole load;
* `parallel` (06): the groups of a 3D mesh, the parameters each rank of a 3D run holds,
  the global gradient norm on a tp x pp mesh, a resharding plan, a graded number;
* `performance` (07): a step's time from its trace, planted problems diagnosed, PowerSGD's
  all-reduce, the MFU question;
* `context_parallel` (08): the online-softmax merge, the zig-zag mask, causal ring
  attention from send/recv, a graded number;
* `questions`: the visible check of every written question answered by a number.
"""
from reference.course.checks.collectives import (
    check_recursive_doubling_all_reduce, check_ring_all_gather, check_ring_all_reduce,
    check_ring_doubling_crossover, check_tree_all_reduce,
)
from reference.course.checks.data_parallel import (
    check_accumulate_gradients, check_average_gradients, check_bucketed_all_reduce,
    check_ddp_bytes_per_step, check_int8_all_reduce,
)
from reference.course.checks.expert_parallel import (
    check_balanced_step, check_dedup_all_to_all_bytes, check_dispatch_combine,
    check_dispatch_combine_dedup, check_global_balance_loss, check_top_k_routing,
)
from reference.course.checks.parallel import (
    check_global_grad_norm, check_mesh_groups, check_parameters_per_rank, check_reshard_plan,
    check_step_bytes_3d,
)
from reference.course.checks.context_parallel import (
    check_causal_ring_attention, check_merge_attention_blocks, check_ring_forward_bytes,
    check_zigzag_mask,
)
from reference.course.checks.performance import (
    check_diagnose, check_mfu, check_powersgd_all_reduce, check_step_breakdown,
)
from reference.course.checks.questions import check_question
from reference.course.checks.pipeline_parallel import (
    check_balance_stages, check_gpipe_actions, check_interleaved_actions,
    check_interleaved_peak_bytes, check_one_f_one_b_actions,
)
from reference.course.checks.tensor_parallel import (
    check_make_tp_dropout, check_sequence_parallel_mlp, check_tensor_parallel_mlp,
    check_tp_layer_bytes, check_vocab_parallel_cross_entropy,
)
from reference.course.checks.zero import (
    check_clip_sharded_grad_norm_, check_fsdp_schedule, check_zero1_optimizer,
    check_zero_max_params,
)

__all__ = [
    "check_ring_all_reduce", "check_ring_all_gather", "check_tree_all_reduce",
    "check_recursive_doubling_all_reduce", "check_ring_doubling_crossover",
    "check_average_gradients", "check_bucketed_all_reduce", "check_accumulate_gradients",
    "check_int8_all_reduce", "check_ddp_bytes_per_step",
    "check_zero1_optimizer", "check_clip_sharded_grad_norm_", "check_fsdp_schedule",
    "check_zero_max_params",
    "check_tensor_parallel_mlp", "check_vocab_parallel_cross_entropy",
    "check_sequence_parallel_mlp", "check_make_tp_dropout", "check_tp_layer_bytes",
    "check_gpipe_actions", "check_one_f_one_b_actions", "check_interleaved_actions",
    "check_balance_stages", "check_interleaved_peak_bytes",
    "check_top_k_routing", "check_dispatch_combine", "check_dispatch_combine_dedup",
    "check_global_balance_loss", "check_dedup_all_to_all_bytes", "check_balanced_step",
    "check_mesh_groups", "check_parameters_per_rank", "check_global_grad_norm",
    "check_reshard_plan", "check_step_bytes_3d", "check_question",
    "check_step_breakdown", "check_diagnose", "check_powersgd_all_reduce", "check_mfu",
    "check_merge_attention_blocks", "check_zigzag_mask", "check_causal_ring_attention",
    "check_ring_forward_bytes",
]
