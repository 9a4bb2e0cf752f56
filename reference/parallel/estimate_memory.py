"""The memory side of `reference.parallel.estimate`: what one GPU of a pipeline stage holds.

    tensors = stage_tensors(GPTConfig(...), config, stage=0, n_experts=8)  # TP-local shapes
    stage_params(model, config, 0)                                         # their numbers
    activation_bytes_per_block(s, b, h, a, tp, sequence_parallel, act_bytes=4)

**Tensors.** `stage_tensors` lists the TP-local shape of every tensor one GPU of a stage holds
after the cuts `parallelize` makes, from the configuration alone (`_block` lists a block's):
the embedding's rows of the vocabulary padded to a multiple of tp (V_pad / tp, C), the head's
own copy of it when it sits on another stage (or is untied), an MoE layer's router (E, C) and
its E / ep experts whole (tensor parallelism never splits an expert). Each tensor is marked
expert or dense (ZeRO-3 shards an expert over its expert-data-parallel group, dp / ep ranks, a
dense tensor over dp) and sequence-parallel or not (with SP its gradient is summed over tp once
a step). ZeRO-3 shards each tensor's dim 0: a rank holds ceil(d0 / N) rows (`Tensor.shard`).

**Activations** (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4): bytes one block stores for one micro-batch of b sequences
of s tokens, h = n_embd, a heads. The paper counts 16-bit activations, 2 bytes each, and
1-byte dropout masks; with e bytes per activation (``act_bytes``: 4 in fp32) its terms are

    LayerNorms' inputs              2 e s b h
    attention                       e s b h (input) + s b h (mask) + 4 e s b h / t (q, k, v, the
                                    projection's input) + (2 e + 1) a s^2 b / t (scores, their
                                    mask, the dropped-out scores)
    MLP                             e s b h (input) + s b h (mask) + 2 (d_ff / h) e s b h / t

which at e = 2 and d_ff = 4 h is the paper's s b h (34 + 5 a s / h) with no tensor
parallelism and s b h (10 + 24 / t + 5 a s / (h t)) with tp = t; sequence parallelism
divides every term by t. Selective recompute drops the scores; full recompute keeps only
each block's input, e s b h (/ t with SP). ``attention="fused"`` (FlashAttention) stores a
log-sum-exp per head and token, 4 a s b / t bytes, instead of the scores. An MoE layer stores
`moe_activation_bytes` in the MLP's place. The head's stage also keeps the loss's fp32
log-probabilities, 4 s b V_pad / t."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Iterable, Optional

from reference.parallel.config import V_SHAPED
from reference.pipeline_parallel import build_schedule

__all__ = ["Tensor", "Tensors", "stage_specs", "rank_specs", "stage_tensors",
           "split_held", "block_params", "stage_params", "activation_bytes_per_block", "mlp_activation_bytes",
           "moe_activation_bytes", "in_flight", "chunk_held", "held_before_i", "zero3_phases"]


@dataclass(frozen=True)
class Tensor:
    """One tensor a rank holds: its TP-local shape and how ZeRO-3 and SP treat it."""

    shape: tuple
    expert: bool = False              # sharded over the expert-data-parallel group (ep > 1)
    sequence_parallel: bool = False   # gradient summed over tp under SP
    unit: str = "root"                # FSDP2's unit: "block i", or the root (embedding, head)

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard(self, n: int) -> int:
        """Numbers a rank holds when dim 0 is split over n ranks: ceil(d0 / n) rows."""
        return -(-self.shape[0] // n) * (self.numel // self.shape[0])


class Tensors(tuple):
    """A stage's tensors, their sums remembered (the explorer asks for them many times)."""

    def _memo(self, key, fn):
        memo = self.__dict__.setdefault("memo", {})
        if key not in memo:
            memo[key] = fn()
        return memo[key]

    def of(self, expert: Optional[bool]) -> "Tensors":
        """The expert tensors (True), the dense ones (False) or all (None)."""
        return self if expert is None else self._memo(
            ("of", expert), lambda: Tensors(x for x in self if x.expert == expert))

    def sizes(self, n: int = 1) -> tuple[int, int, int, int]:
        """(numbers, shard numbers over n ranks, the largest padded tensor, the largest shard)."""
        return self._memo(("sizes", n), lambda: (
            sum(x.numel for x in self), sum(x.shard(n) for x in self),
            max((x.shard(n) * n for x in self), default=0), max((x.shard(n) for x in self), default=0)))

    def marked(self, n: int = 1) -> int:
        """Shard numbers over n ranks (n = 1: all) of the sequence-parallel tensors."""
        return self._memo(("marked", n), lambda: sum(x.shard(n) for x in self if x.sequence_parallel))

    def units(self) -> dict:
        """FSDP2's units: {name: Tensors}."""
        def group():
            out: dict = {}
            for x in self:
                out.setdefault(x.unit, []).append(x)
            return {k: Tensors(v) for k, v in out.items()}
        return self._memo("units", group)


def _block(c: int, d_ff: int, tp: int, bias: bool, unit: str, n_experts: Optional[int],
           ep: int) -> list[Tensor]:
    """One block's tensors on one tp rank (an MoE layer when ``n_experts``)."""
    def t(*shape, expert=False, sp=False):
        return Tensor(tuple(shape), expert, sp, unit)

    out = [t(c, sp=True)] + ([t(c, sp=True)] if bias else [])                # ln_1
    out += [t(3 * c // tp, c)] + ([t(3 * c // tp)] if bias else [])           # c_attn: q|k|v rows
    out += [t(c, c // tp)] + ([t(c, sp=True)] if bias else [])               # c_proj: row-parallel
    out += [t(c, sp=True)] + ([t(c, sp=True)] if bias else [])               # ln_2
    if n_experts is None:
        out += [t(d_ff // tp, c)] + ([t(d_ff // tp)] if bias else [])         # c_fc: column
        out += [t(c, d_ff // tp)] + ([t(c, sp=True)] if bias else [])         # c_proj: row
        return out
    out.append(t(n_experts, c, sp=True))                                      # the router's gate
    for _ in range(n_experts // ep):                                          # whole experts
        out += [t(d_ff, c, expert=True, sp=True), t(c, d_ff, expert=True, sp=True)]
        out += [t(d_ff, expert=True, sp=True), t(c, expert=True, sp=True)] if bias else []
    return out


def rank_specs(model, config, rank: int) -> tuple:
    """The stages pipeline ``rank`` holds: r, r + pp, ... (interleaved), or r and 2 pp - 1 - r
    (the V of ZB-V and DualPipeV)."""
    specs, p = stage_specs(model, config), config.pp
    return (specs[rank], specs[2 * p - 1 - rank]) if config.schedule in V_SHAPED else specs[rank::p]


def stage_specs(model, config) -> tuple:
    """`plan_stages`'s cut of ``model`` (a `GPTConfig`) for ``config``'s pipeline, remembered."""
    from reference.pipeline_parallel.stage import plan_stages

    key = (_shape(model), config.n_stages, config.embedding_stage)
    if key not in _SPECS:
        _SPECS[key] = tuple(plan_stages(model, config.n_stages, embedding_stage=config.embedding_stage,
                                        head_stage=config.embedding_stage))
    return _SPECS[key]


_SPECS: dict = {}
_TENSORS: dict = {}


def _shape(model) -> tuple:
    """What the cut and the tensors depend on (the key they are remembered by)."""
    return (model.vocab_size, model.block_size, model.n_layer, model.n_head, model.n_embd,
            model.d_ff, model.bias, model.tie_weights)


def stage_tensors(model, config, stage: int, n_experts: Optional[int] = None,
                  moe_layers: Optional[Iterable[int]] = None) -> Tensors:
    """Every tensor one GPU of pipeline rank ``stage`` holds (its chunks together), before ZeRO;
    ``n_experts`` per MoE layer (None: dense), ``moe_layers`` the MoE ones (default all)."""
    moe = frozenset(range(model.n_layer) if moe_layers is None else moe_layers) if n_experts else frozenset()
    key = (_shape(model), config.n_stages, config.embedding_stage, config.tp, config.pp, config.ep,
           stage, n_experts, moe)
    if key not in _TENSORS:  # the explorer asks for the same stages many times
        _TENSORS[key] = Tensors(_stage_tensors(model, config, stage, n_experts, moe))
    return _TENSORS[key]


def _stage_tensors(model, config, stage, n_experts, moe) -> list[Tensor]:
    tp, c = config.tp, model.n_embd
    vocab = (-(-model.vocab_size // tp), c)  # V_pad / tp rows: V padded to a multiple of tp
    out = []
    for spec in rank_specs(model, config, stage):
        if spec.embedding:
            out += [Tensor(vocab), Tensor((model.block_size, c))]                 # wte, wpe
        for i in spec.layers:
            out += _block(c, model.d_ff, tp, model.bias, f"block {i}",
                          n_experts if i in moe else None, config.ep)
        if spec.head:
            out += [Tensor((c,), sequence_parallel=True)] * (2 if model.bias else 1)  # ln_f
            if not (spec.embedding and model.tie_weights):  # a copy of wte, or its own matrix
                out.append(Tensor(vocab))
    return out


def block_params(n_embd: int, d_ff: int, tp: int = 1, bias: bool = True) -> int:
    """Numbers one tp rank holds for one dense block: split matrices and column biases / tp,
    LayerNorms and row-parallel biases whole."""
    return sum(x.numel for x in _block(n_embd, d_ff, tp, bias, "block", None, 1))


def stage_params(model, config, stage: int, n_experts: Optional[int] = None,
                 moe_layers: Optional[Iterable[int]] = None) -> int:
    """Numbers one GPU of pipeline ``stage`` holds (chunks of an interleaved rank summed)."""
    return stage_tensors(model, config, stage, n_experts, moe_layers).sizes()[0]


def activation_bytes_per_block(s: int, b: int, h: int, a: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none", *,
                               act_bytes: int = 2, d_ff: Optional[int] = None,
                               attention: str = "unfused") -> float:
    """Korthikanti et al.'s bytes of one dense block's activations for one micro-batch, with
    ``act_bytes`` per activation (the paper: 2) and 1-byte dropout masks."""
    if attention not in ("unfused", "fused"):
        raise ValueError(f"attention must be 'unfused' or 'fused', got {attention!r}")
    e, t = act_bytes, tp
    sp = sequence_parallel and t > 1
    whole = t if sp else 1             # what tp does not split is split by SP
    sbh = s * b * h
    if recompute == "full":
        return e * sbh / whole
    norms = 2 * e * sbh / whole
    attn = (e + 1) * sbh / whole + 4 * e * sbh / t
    if recompute != "selective":       # selective recomputes the attention core
        attn += (2 * e + 1) * a * s * s * b / t if attention == "unfused" else 4 * a * s * b / t
    return norms + attn + mlp_activation_bytes(s, b, h, d_ff or 4 * h, tp, sequence_parallel, act_bytes)


def mlp_activation_bytes(s: int, b: int, h: int, d_ff: int, tp: int = 1,
                         sequence_parallel: bool = False, act_bytes: int = 2) -> float:
    """The MLP's part of `activation_bytes_per_block`: its input and dropout mask (split by SP),
    the fc and GeLU outputs (split by tp)."""
    t = tp
    whole = t if sequence_parallel and t > 1 else 1
    return (act_bytes + 1) * s * b * h / whole + 2 * act_bytes * s * b * d_ff / t


def moe_activation_bytes(s: int, b: int, h: int, d_ff: int, k: int, act_bytes: int = 2, *,
                         n_experts: int, normalize_weights: Optional[bool] = None) -> float:
    """What an MoE layer (`reference.expert_parallel.moe`) stores in the MLP's place for one
    micro-batch, on every tp rank (under SP it routes the gathered sequence), per token:

        activations, e bytes each   h (input) + k h (the dispatched copies) + 2 k d_ff (each
                                    copy's fc and GeLU outputs) + 2 k h (the expert outputs the
                                    combine weighs, and their weighted copy, which `index_add`
                                    keeps) + k (the combine weights, in the outputs' dtype)
        router, fp32                2 E (logits, for the z-loss's log-sum-exp; probabilities,
                                    the softmax's output) + 1 (the log-sum-exp) + k + 1 with
                                    the weights renormalised (the top-k probabilities, their sum)
        indices, int64              3 k (top-k choices, kept assignments, their token rows)

    and E = ``n_experts`` fp32 per sequence (the balance loss's assignment fractions). Exact,
    measured, when no assignment is dropped at capacity and, under ep, when a rank's experts
    receive as many rows as it dispatches. ``normalize_weights`` defaults to the router's, k > 1."""
    normalized = k > 1 if normalize_weights is None else normalize_weights
    tokens, e, n = s * b, act_bytes, n_experts
    activations = e * tokens * (h * (1 + 3 * k) + 2 * k * d_ff + k)
    router = 4 * tokens * (2 * n + 1 + (k + 1 if normalized else 0)) + 4 * b * n
    return activations + router + 8 * tokens * 3 * k


def in_flight(config, m: int, rank: int) -> tuple[float, float, float]:
    """Micro-batches whose activations pipeline ``rank`` holds, in whole-stage units: (at its
    first backward, at its later backwards, at its peak). 1F1B holds min(p - r, m) on rank r,
    one fewer from its first backward on when m <= p - r; GPipe all m, then one fewer;
    interleaved 1F1B min(m v, 2 (p - r - 1) + (v - 1) p + 1) chunks of 1 / v (an upper bound
    when m < p). The zero-bubble schedules hold a micro-batch from F to W: ZB-H1 min(p, m)
    (min(p - r, m) at its first backward), ZB-V min(2p, m + r + 1, 2m) half-stage chunks,
    DualPipeV min(2p + 1, 2m) (from its I each holds what its W needs instead: `split_held`)."""
    p, v = config.pp, config.virtual_stages
    if config.schedule == "zb-h1" and p > 1:
        return min(p - rank, m), min(p, m), min(p, m)
    if config.schedule == "zb-h2" and p > 1:  # read off its action list (up to 2p - 1)
        peak = max(held for held, _ in _walk(config, m, rank))
        return peak, peak, peak
    if config.schedule in V_SHAPED and p > 1:
        peak = (min(2 * p, m + rank + 1, 2 * m) if config.schedule == "zb-v" else min(2 * p + 1, 2 * m)) / 2
        return peak, peak, peak
    if v > 1:
        peak = min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1) / v
        return peak, peak, peak
    first = m if config.schedule == "gpipe" and p > 1 else min(p - rank, m)
    later = first - 1 if first == m else first
    return first, later, first


def _walk(config, m: int, rank: int) -> list:
    """(micro-batches held from F to W, of which past their I) after each action of ``rank``
    under ``config``'s schedule (one chunk per rank), read off its action list."""
    held = past = 0
    out = []
    for a in build_schedule(config.schedule, config.pp, m).actions(rank):
        held += (a.op == "F") - (a.op == "W")
        past += (a.op == "I") - (a.op == "W")
        out.append((held, past))
    return out


def split_held(config, m: int, rank: int) -> tuple:
    """The zero-bubble schedules' candidates for their peak on pipeline ``rank``: pairs (micro-
    batches held from F to I, micro-batches held from I to W), in whole-stage units; the peak is
    the largest of F-bytes x the first + I-bytes x the second (which one depends on their ratio).
    Read off the schedule's action list (`chunk_held`'s walk, its chunks added up). Other
    schedules: (`in_flight`'s peak, 0)."""
    from reference.pipeline_parallel import ZB_KINDS

    counts = chunk_held(config, m, rank) if config.schedule in ZB_KINDS and config.pp > 1 else ()
    if not counts:
        return ((in_flight(config, m, rank)[2], 0),)
    v = config.virtual_stages
    pairs = {(sum(n[:v]) / v, sum(n[v:]) / v) for n in counts}
    return tuple(sorted(x for x in pairs if not any(y != x and y[0] >= x[0] and y[1] >= x[1] for y in pairs)))


def held_before_i(config, m: int, rank: int) -> tuple:
    """`split_held`'s pairs at the moments an I starts (where a checkpointed chunk runs its
    forward again, on top of them); () for a schedule without I."""
    from reference.pipeline_parallel import ZB_KINDS

    if config.schedule not in ZB_KINDS or config.pp == 1:
        return ()
    v = config.virtual_stages
    return tuple({(sum(n[:v]) / v, sum(n[v:]) / v)
                  for n in _chunk_held(config.schedule, config.pp, min(m, 2 * config.pp), v, rank, True)})


def chunk_held(config, m: int, rank: int) -> tuple:
    """A zero-bubble schedule's candidates for its peak on pipeline ``rank``, chunk by chunk:
    (F0, .., I0, ..), the chunk-micro-batches of each of its stages held from F to I, then those
    held from I to W, read off the schedule's action list (the states no other state dominates);
    () when the schedule cannot be built. ZB-V's rank r at m >= 2p: (2p - r, r, 0, 0),
    (2p - 1 - r, r, 0, 1), (p - r - 1, r, r + 1, 0) among others."""
    # from m = 2p on the steady state only repeats: the counts are those of m = 2p
    return _chunk_held(config.schedule, config.pp, min(m, 2 * config.pp), config.virtual_stages, rank)


@lru_cache(maxsize=None)
def _chunk_held(kind: str, p: int, m: int, v: int, rank: int, before_i: bool = False) -> tuple:
    """`chunk_held` of the ``kind`` schedule with p ranks, m micro-batches and v chunks a rank
    (``before_i``: the states as each I starts, all of them)."""
    from reference.pipeline_parallel import build_schedule

    try:
        actions = build_schedule(kind, p, m, v).actions(rank)
    except ValueError:
        return ()
    now, seen, starts = [0] * (2 * v), set(), set()
    for a in actions:  # F holds a chunk-micro-batch, I trades it for what W needs, W and B free it
        step = {"F": (1, 0), "I": (-1, 1), "W": (0, -1), "B": (-1, 0)}.get(a.op)
        if a.op == "I":
            starts.add(tuple(now))
        if step:
            now[a.chunk] += step[0]
            now[v + a.chunk] += step[1]
            seen.add(tuple(now))
    if before_i:
        return tuple(sorted(starts))
    return tuple(sorted(x for x in seen
                        if not any(y != x and all(v >= u for u, v in zip(x, y)) for y in seen)))


def zero3_phases(sets, precision, a1: float, first: float, later: float, work: float,
                 head: bool, reshard: bool = False, recompute: bool = False) -> tuple[dict, float]:
    """Composed ZeRO-3's step, phase by phase: ({phase: peak bytes}, bytes held whole).

    ``sets``: [(`Tensors`, N)] sharded over N ranks each, in the order they are gathered (dense
    over dp, then experts over edp); ``a1``, ``first``, ``later``, ``work`` as `estimate`'s
    `activations` gives them; ``head``: the stage holds the loss. With P the stage's numbers,
    S the rank's shard (padded per tensor), O the optimizer state of the shard, p and g bytes
    per parameter and gradient, gathering once a step:

        gather          O + p (2 S + N S + P + the largest padded tensor)
        pipeline        O + p P + max(A(first - 1) + max(a1, g P), A(later) + g P) + work
        reduce-scatter  O + (p + g) P + g (N S + the largest shard) (+ 4: the loss)

    A(n) = n a1; the first backward's gradients grow as its micro-batch's activations go, so
    they count max(a1, g P) there. Resharding after every forward (`reference.zero.fsdp_reshard`)
    keeps the shards and their gradients, the root unit (embedding, head) and one block whole
    (every block once recomputed), and during a backward one unit's whole gradients and
    collective buffers beside the activations:

        pipeline        O + (p + g) S + p (root + block) + A(first - 1)
                        + max(a1, g (root + block) + (N + 1) x the largest unit's shard) + work

    (an upper bound: the unit's gradients and buffers come as its micro-batch's activations
    go, and are counted beside all of them)."""
    pb, gb = precision.param, precision.grad
    P = sum(ts.sizes(n)[0] for ts, n in sets)
    S = sum(ts.sizes(n)[1] for ts, n in sets)
    O = precision.optimizer * S

    def backward(grads):  # the stored activations and the gradients during a backward
        return max((first - 1) * a1 + max(a1, grads), later * a1 + grads if later > 0 else 0) + work

    if reshard:
        everything, n = sets[0]  # (experts refuse resharding: one set)
        units = dict(everything.units())
        root = units.pop("root", Tensors())
        block = max((u.sizes(n)[0] for u in units.values()), default=0)
        unit_shard = max(u.sizes(n)[1] for u in [root, *units.values()])
        root = root.sizes(n)[0]
        params = pb * (P if recompute else root + block)
        unit = gb * (root + block) + max(pb, gb) * (n + 1) * unit_shard
        pipeline = O + (pb + gb) * S + params + (first - 1) * a1 + max(a1, unit) + work
        return {"pipeline": pipeline}, params + gb * (root + block)
    gather, reduce, whole, shards, done, left = 0.0, 0.0, 0, S, 0, P
    for ts, n in sets:
        Pi, Si, padded, largest = ts.sizes(n)
        shards -= Si
        gather = max(gather, O + pb * (whole + shards + 2 * Si + n * Si + Pi + padded))
        whole += Pi
        reduce = max(reduce, O + (pb + gb) * (done + left) + gb * (n * Si + largest))
        done, left = done + Si, left - Pi
    phases = {"gather": gather, "pipeline": O + pb * P + backward(gb * P),
              "reduce-scatter": reduce + (4 if head else 0)}
    return phases, (pb + gb) * P
