"""The traffic side of `reference.parallel.estimate`: bytes one GPU sends per step, by link.

Ring algorithms, as `reference.comms` counts them. S = b s h x activation bytes is one
activation of one micro-batch, U = (t - 1) / t S one all-gather or reduce-scatter of it over
tp = t, and an all-reduce is 2 U:

* tp, per micro-batch: 4 U per block for its attention and 4 U for its MLP (2 forward,
  2 backward: all-reduces, or with SP an all-gather and a reduce-scatter, the same bytes), and
  with SP and ``regather_input`` (the default under SP: Megatron's form, the one the activation
  terms assume) 1 U more in backward for each column-parallel layer's input gathered again
  (c_attn, a dense c_fc, the head): 6 U per dense block in backward where the course's executor,
  which keeps the gathered input, sends 4; an
  MoE layer, which tp does not split, 0, or with SP 2 U; the embedding 2 U (+ U with SP), the
  head 2 U and the loss 3 all-reduces of b s fp32 numbers; full recompute repeats the
  forward's. Once per step with SP, the all-reduce of the sequence-parallel gradients;
* pp: one activation forward and one gradient backward per micro-batch, S each (S / t with
  SP), for a middle stage; the first sends activations only, the last gradients only;
* dp, P the stage's parameters, g bytes per gradient element reduced, q per parameter
  gathered (the precision's: Megatron's distributed optimizer in bf16 reduce-scatters fp32
  gradients, g = 4, and all-gathers bf16 parameters, q = 2), m micro-batches per step, each
  where it happens, as `reference.zero` does it (`Estimate.dp_transfers` lists them with what
  each may hide under):

      ZeRO-0     the gradients' all-reduce, once per step             2 (d-1)/d P g
                 (with experts, ep > 1: the experts' over dp / ep)
      ZeRO-1     reduce-scatter + all-gather, once per step           (d-1)/d P (g + q)
      ZeRO-2     a reduce-scatter per micro-batch + the all-gather
                 once per step                                        (d-1)/d P (m g + q)
      ZeRO-3     by blocks: per micro-batch two all-gathers and a
                 reduce-scatter (a third all-gather recomputed:       m (d-1)/d P (2 q + g)
                 3 q with activation checkpointing)
      ZeRO-3     composed: the stage gathered once per step, its
                 gradients reduce-scattered once, per group (dense
                 over N = dp, experts over N = dp / ep)               (N-1) S (q + g)
      ZeRO-3     composed, ``reshard_after_forward=True``: gathered
                 for every forward and backward, reduce-scattered
                 after every backward                                 m (N-1) S (2 q + g)

  with S the rank's shard, padded per tensor ((N-1) S = (N-1)/N P when N divides every dim 0).

The experts' all-to-all is not counted (it depends on the routing:
`reference.expert_parallel.comms`). `tests/test_parallel_estimate.py` compares each of these
with the bytes `reference.comms.meter` counts on the tiny model, exactly."""
from __future__ import annotations

__all__ = ["tp_bytes", "dp_transfers", "transfer_link"]


def transfer_link(what: str) -> str:
    """The group a `dp_transfers` entry crosses: "dp_replicate" (HSDP's all-reduce across the
    replicas) or "dp" (the group ZeRO shards over; HSDP's dp_shard)."""
    return "dp_replicate" if what.endswith("over dp_replicate") else "dp"


def tp_bytes(w) -> float:
    """Bytes one GPU sends over tp per step (the module docstring's list), for the `Workload` ``w``."""
    config, tensors = w.config, w.tensors
    t, sp = config.tp, config.sequence_parallel and config.tp > 1
    U = (t - 1) / t * w.activation                              # one all-gather / reduce-scatter
    blocks, moe_blocks, head = w.blocks, w.moe_blocks, w.holds("head")
    counts = (len(blocks), len(blocks) - len(moe_blocks), len(moe_blocks), w.holds("embedding"), head, sp)
    tokens = w.seq_len * w.micro_batch
    loss = 3 * 2 * (t - 1) / t * 4 * tokens if head else 0.0   # max, sum of exp, target logit
    forward = _tp_forward(*counts) * U + loss
    # regathering: c_attn's input, a dense MLP's c_fc's and the head's all-gathered again in backward
    regather = (counts[0] + counts[1] + head) * U if sp and w.regather_input else 0.0
    per_mb = (forward + _tp_backward(*counts) * U + regather
              + (forward if w.recompute == "full" else 0.0))
    # once per step with SP: the gradients of the sequence-parallel tensors summed over tp (on
    # the shards when resharding: every micro-batch's gradients are reduce-scattered already)
    marked = tensors.marked(config.dp if w.reshard else 1)
    return w.m * per_mb + (2 * (t - 1) / t * w.grad_bytes * marked if sp else 0.0)


def _tp_forward(n_blocks, dense, moe, embedding, head, sp) -> int:
    """Forward collectives in units U: an attention 2, a dense MLP 2, an MoE layer 1 with SP."""
    return 2 * n_blocks + 2 * dense + (moe if sp else 0) + 2 * embedding + (1 if sp and head else 0)


def _tp_backward(n_blocks, dense, moe, embedding, head, sp) -> int:
    return (2 * n_blocks + 2 * dense + (moe if sp else 0) + (1 if sp and embedding else 0)
            + ((1 if sp else 2) if head else 0))


def dp_transfers(w) -> tuple:
    """Data parallelism's transfers for the `Workload` ``w`` (the module docstring's table): (what,
    bytes each, times per step, what it may hide under)."""
    config, tensors, m, g, q, reshard = w.config, w.tensors, w.m, w.grad_bytes, w.param_bytes, w.reshard
    params = tensors.sizes()[0]
    d, ep = config.dp, config.ep
    if d == 1:
        return ()
    once, gather = (d - 1) / d * params * g, (d - 1) / d * params * q  # a reduce-scatter, an all-gather
    if w.composed:  # per group: dense rows over dp (HSDP: dp_shard), experts' over dp / ep
        R = config.dp_replicate
        sets = ([(False, d, "dp"), (True, d // ep, "dp / ep")] if ep > 1 else
                [(None, d // R, "dp_shard" if R > 1 else "dp")])
        out = []
        if R > 1:  # HSDP: each shard's gradient all-reduced across the replicas (a ring of R)
            rows = tensors.sizes(d // R)[1]
            out.append((f"the gradient shards' all-reduce across {R} replicas, over dp_replicate",
                        2 * (R - 1) / R * rows * g, 1, "backward"))
        for expert, n, over in sets:
            rows = tensors.of(expert).sizes(n)[1]
            what = "" if expert is None else (" (experts)" if expert else " (dense)")
            sent, gathered = (n - 1) * rows * g, (n - 1) * rows * q
            if not rows or n == 1:
                continue
            if reshard:
                out += [(f"all-gathers before each forward and backward{what}, over {over}", 2 * gathered,
                         m, "micro-batch"),
                        (f"a reduce-scatter after each backward{what}, over {over}", sent, m, "backward")]
            else:
                out += [(f"the stage's parameters all-gathered once per step{what}, over {over}", gathered,
                         1, ""),
                        (f"the gradients' reduce-scatter once per step{what}, over {over}", sent, 1,
                         "backward")]
        return tuple(out)
    if config.zero_stage == 0 and ep > 1:  # experts averaged over dp / ep, the rest over dp
        e = d // ep
        n_exp = tensors.of(True).sizes()[0]
        return (("the dense gradients' all-reduce", 2 * (d - 1) / d * (params - n_exp) * g, 1, "backward"),
                ("the experts' all-reduce over dp / ep", 2 * (e - 1) / e * n_exp * g, 1, "backward"))
    return {
        0: (("the gradients' all-reduce", 2 * once, 1, "backward"),),
        1: (("the gradients' reduce-scatter", once, 1, "backward"),
            ("the parameters' all-gather after the step", gather, 1, "")),
        2: (("a reduce-scatter per micro-batch", once, m, "backward"),
            ("the parameters' all-gather after the step", gather, 1, "")),
        3: (("all-gathers (forward, recomputed, backward) and a reduce-scatter per micro-batch", 3 * gather + once, m,
             "micro-batch"),) if config.activation_checkpointing else
           (("all-gathers (forward, backward) and a reduce-scatter per micro-batch", 2 * gather + once, m,
             "micro-batch"),),
    }[config.zero_stage]
