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

* `collectives` (00): ring all-reduce and all-gather from send/recv;
* `data_parallel` (01): averaged and bucketed gradient all-reduce;
* `zero` (02): a ZeRO-1 optimizer;
* `tensor_parallel` (03): the TP MLP with f and g, vocab-parallel cross-entropy;
* `pipeline_parallel` (04): GPipe and 1F1B as action lists;
* `expert_parallel` (05): top-k routing with capacity, dispatch and combine;
* `parallel` (06): the groups of a 3D mesh, the parameters each rank of a 3D run holds,
  the global gradient norm on a tp x pp mesh, a resharding plan, a graded number;
* `questions`: the visible check of every written question answered by a number.
"""
from reference.course.checks.collectives import check_ring_all_gather, check_ring_all_reduce
from reference.course.checks.data_parallel import check_average_gradients, check_bucketed_all_reduce
from reference.course.checks.expert_parallel import check_dispatch_combine, check_top_k_routing
from reference.course.checks.parallel import (
    check_dp_gradient_bytes, check_global_grad_norm, check_mesh_groups, check_parameters_per_rank,
    check_reshard_plan,
)
from reference.course.checks.questions import check_question
from reference.course.checks.pipeline_parallel import check_gpipe_actions, check_one_f_one_b_actions
from reference.course.checks.tensor_parallel import (
    check_tensor_parallel_mlp, check_vocab_parallel_cross_entropy,
)
from reference.course.checks.zero import check_zero1_optimizer

__all__ = [
    "check_ring_all_reduce", "check_ring_all_gather",
    "check_average_gradients", "check_bucketed_all_reduce",
    "check_zero1_optimizer",
    "check_tensor_parallel_mlp", "check_vocab_parallel_cross_entropy",
    "check_gpipe_actions", "check_one_f_one_b_actions",
    "check_top_k_routing", "check_dispatch_combine",
    "check_mesh_groups", "check_parameters_per_rank", "check_global_grad_norm",
    "check_reshard_plan", "check_dp_gradient_bytes", "check_question",
]
