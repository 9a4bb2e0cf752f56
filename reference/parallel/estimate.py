"""What a parallel configuration costs per GPU, from formulas: memory, bubble, bytes per link,
and an estimated step time.

    e = estimate(GPTConfig(...), ParallelConfig.article_175b(), micro_batch=1, global_batch=1536)
    e.memory_gb, e.fits(80e9), e.bubble, e.bytes_per_step   # per GPU
    step_time(e)["total"]                 # seconds, under Hardware()'s assumptions

Memory per GPU (the pipeline's first stage, the heaviest):

* parameters: the blocks of one stage, split by tp, plus the embedding (split by tp over
  the vocabulary) and the learned positions; each block holds 12 C^2 + 13 C numbers
  (q, k, v, the output projection, the two MLP matrices, their biases and two LayerNorms),
  of which the LayerNorms and the row-parallel biases (6 C) stay whole on every tp rank;
* gradients and optimizer state: `reference.memory.model_state_bytes` (ZeRO's formulas)
  applied to those parameters over the dp ranks;
* activations (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
  Transformer Models", section 4), per block and micro-batch of b sequences of s tokens,
  h = n_embd, a = heads, 16-bit activations with 1-byte dropout masks:

      no tensor parallelism          s b h (34 + 5 a s / h)
      tp = t                         s b h (10 + 24 / t + 5 a s / (h t))
      tp = t with sequence parallel  s b h (34 / t + 5 a s / (h t))
      full recompute                 2 s b h (/ t with SP): only each block's input is kept

  and 1F1B's first stage holds pp micro-batches in flight, so it keeps L / pp blocks x pp
  micro-batches = L blocks' worth whatever pp is (interleaving: times 1 + (pp - 1) / (pp v)).

Bubble: (pp - 1) / (m + pp - 1), m micro-batches per step (interleaved: (pp - 1) / (v m + pp - 1)).

Bytes each GPU sends per step, by link (ring algorithms, as `reference.comms` counts them;
S = b s h x activation bytes, one activation of one micro-batch):

* tp (inside a node): 4 all-reduces of S per block per micro-batch (2 forward, 2 backward),
  each 2 (t-1)/t S; sequence parallelism swaps each for an all-gather plus a reduce-scatter,
  the same bytes; full recompute repeats the forward's 2;
* pp (across nodes): one activation forward and one gradient backward per micro-batch, S each
  (S / t with sequence parallelism: the activation between stages is sequence-split);
* dp (across nodes), P the stage's parameters, g bytes per gradient element, m micro-batches
  per step (accumulation when pp = 1), each where it happens, as `reference.zero` does it:

      ZeRO-0     the gradients' all-reduce, once per step             2 (d-1)/d P g
      ZeRO-1     reduce-scatter + all-gather, once per step           2 (d-1)/d P g
      ZeRO-2     a reduce-scatter per micro-batch (its backward's hooks: no full gradient
                 to accumulate into) + the all-gather once per step  (m + 1) (d-1)/d P g
      ZeRO-3     per micro-batch, two all-gathers (forward, backward)
                 and a reduce-scatter (FSDP by blocks: tp = pp = 1,
                 no recompute)                                        3 m (d-1)/d P g
      ZeRO-3     composed with tp, pp or recompute (`ShardedParameters`):
                 the stage gathered once per step and kept through its
                 micro-batches, its gradients reduce-scattered once   2 (d-1)/d P g

  (so ZeRO-2 and block-wise ZeRO-3 pay for accumulation, and `ParallelConfig` refuses ZeRO-2
  with a pipeline; the composed ZeRO-3 pays in memory instead: the whole stage's parameters
  and gradients, P (param + grad bytes), are held during the step, `Estimate.held_in_step`;
  the flat layout's padding of P to a multiple of d is left out).
  `Estimate.dp_transfers` lists these transfers with what each may hide under.

Step time (`step_time`, under `Hardware`'s assumptions, each shown in `Hardware.describe`):
compute = the step's training FLOPs (`reference.profile.training_flops`, plus the forward
again with full recompute, plus attention's with selective) over the GPUs, at the peak
FLOP/s; tp and pp traffic is exposed (a TP collective's output is the next matmul's input,
a stage waits for its neighbour's activation); dp traffic hides under the compute it runs
beside (DDP's buckets and ZeRO-1's reduce-scatter under the last micro-batch's backward,
ZeRO-2's under each backward, ZeRO-3's prefetched gathers under each micro-batch) and only
what outlasts it is exposed; the parameters' all-gather after the optimizer step is
exposed; the bubble idles (pp - 1) / (v m) of the busy time (compute + tp + pp). A link is
NVLink when its group fits in one node (Megatron's order, tp innermost, then dp, then pp),
else the GPU's share of the node's NICs; latency (alpha) is left out.

The course's tests check these formulas against the tiny model's measured parameters and
bytes (`tests/test_parallel_estimate.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from reference.comms.links import GPUS_PER_NODE, NIC, NICS_PER_NODE, NVLINK, Link
from reference.memory import MemoryBytes, Precision, human_bytes, model_state_bytes
from reference.parallel.config import ParallelConfig
from reference.profile import training_flops

__all__ = ["Estimate", "estimate", "block_params", "stage_params", "activation_bytes_per_block",
           "Hardware", "H100_BF16_PEAK", "step_time", "link_of"]

# FLOP/s of an H100 SXM's dense bf16 tensor cores (the datasheet's peak; the node whose links
# reference.comms.links describes). Real steps reach about half of it: compute here is a floor.
H100_BF16_PEAK = 989e12


@dataclass(frozen=True)
class Hardware:
    """What `step_time` assumes: the peak FLOP/s of one GPU and its links (defaults: the H100
    node of `reference.comms.links`, one NIC per GPU)."""

    peak_flops: float = H100_BF16_PEAK
    intra: Link = NVLINK              # inside a node
    inter: Link = NIC                 # one network card to another node
    gpus_per_node: int = GPUS_PER_NODE
    nics_per_node: int = NICS_PER_NODE

    @property
    def inter_bandwidth(self) -> float:
        """Bytes/s one GPU sends across nodes: its share of the node's NICs."""
        return self.inter.bandwidth * self.nics_per_node / self.gpus_per_node

    def describe(self) -> str:
        return (f"compute at {self.peak_flops / 1e12:.0f} TFLOP/s per GPU (peak); "
                f"{self.intra.bandwidth / 1e9:.0f} GB/s per GPU inside a node of {self.gpus_per_node}, "
                f"{self.inter_bandwidth / 1e9:.0f} GB/s across nodes; tp and pp traffic exposed, "
                f"dp traffic hidden under the backward it runs beside (ZeRO-3: under each "
                f"micro-batch) up to its length, the all-gather after the step exposed; "
                f"bubble (pp-1)/(v m) of the busy time; latency left out")


def _pad(v: int, t: int) -> int:
    return -(-v // t) * t


def block_params(n_embd: int, d_ff: int, tp: int = 1, bias: bool = True) -> int:
    """Numbers one tp rank holds for one block: split matrices and column biases / tp,
    LayerNorms and row-parallel biases whole."""
    c = n_embd
    split = 3 * c * c + c * c + 2 * c * d_ff + ((3 * c + d_ff) if bias else 0)  # c_attn, c_proj, fc, proj
    whole = 2 * 2 * c if bias else 2 * c                                         # ln_1, ln_2
    whole += 2 * c if bias else 0                                                # the two row biases
    return split // tp + whole


def stage_params(model, config: ParallelConfig, stage: int) -> int:
    """Numbers one GPU of pipeline ``stage`` holds (chunks of an interleaved rank summed)."""
    from reference.pipeline_parallel.stage import plan_stages

    specs = plan_stages(model, config.n_stages, embedding_stage=config.embedding_stage,
                        head_stage=config.embedding_stage)
    tp, c = config.tp, model.n_embd
    total = 0
    for spec in specs[stage::config.pp]:
        total += len(spec.layers) * block_params(c, model.d_ff, tp, model.bias)
        if spec.embedding:
            total += _pad(model.vocab_size, tp) * c // tp + model.block_size * c
        if spec.head:
            total += 2 * c if model.bias else c  # ln_f
            tied_here = spec.embedding and model.tie_weights
            if not tied_here:  # a copy of the (padded, split) embedding, or its own matrix
                total += _pad(model.vocab_size, tp) * c // tp
    return total


def activation_bytes_per_block(s: int, b: int, h: int, a: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Korthikanti et al.'s bytes of one block's activations for one micro-batch."""
    if recompute == "full":
        return 2 * s * b * h / (tp if sequence_parallel else 1)
    if recompute == "selective":  # the attention core (the 5 a s / h term) is recomputed
        return s * b * h * (34 / tp if sequence_parallel else 10 + 24 / tp)
    if tp == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if sequence_parallel:
        return s * b * h * (34 / tp + 5 * a * s / (h * tp))
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))


@dataclass
class Estimate:
    config: ParallelConfig
    params_per_gpu: int
    model_states: MemoryBytes
    activations: float
    bubble: float
    bytes_per_step: dict = field(default_factory=dict)  # link -> bytes one GPU sends per step
    microbatches: int = 1             # m per step (accumulation when pp = 1)
    flops: float = 0.0                # training FLOPs one GPU computes per step, recompute included
    forward_flops: float = 0.0        # of which the first forward's
    # dp's transfers: (what, bytes each, times per step, hides under "backward" / "micro-batch" / "")
    dp_transfers: tuple = ()
    held_in_step: float = 0.0         # composed ZeRO-3: the stage's gathered parameters and gradients

    @property
    def total_bytes(self) -> float:
        return self.model_states.model_states + self.activations + self.held_in_step

    @property
    def memory_gb(self) -> float:
        return self.total_bytes / 1e9

    def fits(self, device_bytes: float = 80e9) -> bool:
        return self.total_bytes <= device_bytes

    def table(self) -> str:
        ms = self.model_states
        rows = [("parameters", ms.params), ("gradients", ms.grads),
                ("optimizer state", ms.optimizer_state), ("activations", self.activations)]
        if self.held_in_step:
            rows.append(("gathered in step", self.held_in_step))
        rows.append(("total", self.total_bytes))
        out = [f"{self.config}: {self.params_per_gpu / 1e9:.2f}B parameters per GPU"]
        out += [f"  {name:<16} {human_bytes(v):>10}" for name, v in rows]
        out.append(f"  bubble {self.bubble:.1%}; bytes sent per step: " + ", ".join(
            f"{k} {human_bytes(v)}" for k, v in self.bytes_per_step.items()))
        return "\n".join(out)


def estimate(model, config: ParallelConfig, *, micro_batch: int, global_batch: int,
             seq_len: int | None = None, precision: Precision | None = None,
             act_bytes: int = 2, grad_bytes: int | None = None, recompute: str | None = None) -> Estimate:
    """Memory per GPU of the first pipeline stage, the bubble and bytes per step per link.

    ``model`` a `GPTConfig`; ``micro_batch`` b sequences per micro-batch per dp rank;
    ``global_batch`` sequences per step (so m = global_batch / (dp b) micro-batches).
    ``recompute`` "none", "selective" or "full" (default: full when the config checkpoints)."""
    if config.cp > 1:  # its activations (T / cp per rank) and ring traffic are not modelled here
        raise ValueError(f"estimate models dp, tp, pp and ep: cp={config.cp} ({config}) is not in its "
                         f"formulas (see reference.context_parallel.cost for context parallelism's)")
    precision = precision or (Precision.fp32_adam() if config.precision == "fp32" else Precision.mixed_adam())
    grad_bytes = precision.grad if grad_bytes is None else grad_bytes
    recompute = recompute or ("full" if config.activation_checkpointing else "none")
    s = seq_len or model.block_size
    b, h, a, L = micro_batch, model.n_embd, model.n_head, model.n_layer
    if global_batch % (config.dp * b):
        raise ValueError(f"global_batch={global_batch} is not a multiple of dp={config.dp} x "
                         f"micro_batch={b}")
    m = global_batch // (config.dp * b)
    t, p, d, v = config.tp, config.pp, config.dp, config.virtual_stages
    params = stage_params(model, config, 0)
    states = model_state_bytes(params, d, config.zero_stage, precision)
    per_block = activation_bytes_per_block(s, b, h, a, t, config.sequence_parallel, recompute)
    in_flight = min(m, p) / p * (1 + (p - 1) / (p * v) if v > 1 else 1)
    acts = L * per_block * in_flight
    bubble = (p - 1) / (v * m + p - 1)
    S = s * b * h * act_bytes
    blocks_here = L / p
    tp_calls = 4 + (2 if recompute == "full" else 0)
    # Data parallelism, each transfer where it happens (the module docstring's table).
    once = (d - 1) / d * params * grad_bytes if d > 1 else 0.0
    dp_transfers = {
        0: (("the gradients' all-reduce", 2 * once, 1, "backward"),),
        1: (("the gradients' reduce-scatter", once, 1, "backward"),
            ("the parameters' all-gather after the step", once, 1, "")),
        2: (("a reduce-scatter per micro-batch", once, m, "backward"),
            ("the parameters' all-gather after the step", once, 1, "")),
        3: (("all-gathers (forward, backward) and a reduce-scatter per micro-batch", 3 * once, m,
             "micro-batch"),),
    }.get(config.zero_stage, ()) if d > 1 else ()
    # ZeRO-3 composed with tp, pp or recompute shards each tensor (`ShardedParameters`): the
    # stage is gathered once per step and held whole through its micro-batches.
    composed = config.zero_stage == 3 and d > 1 and not config.zero3_by_blocks
    held = 0.0
    if composed:
        dp_transfers = (("the stage's parameters all-gathered once per step", once, 1, ""),
                        ("the gradients' reduce-scatter once per step", once, 1, "backward"))
        held = params * (precision.param + precision.grad)
    per_gpu = {
        "tp": blocks_here * m * tp_calls * 2 * (t - 1) / t * S if t > 1 else 0.0,
        # a middle stage sends an activation on and a gradient back per micro-batch; with
        # pp = 2 each end sends one of the two
        "pp": (2 if p > 2 else 1) * m * S / (t if config.sequence_parallel else 1) if p > 1 else 0.0,
        "dp": sum(nbytes * times for _, nbytes, times, _ in dp_transfers),
    }
    # FLOPs: the whole model's over every GPU (tokens split by dp, weights by tp and pp)
    world = d * t * p
    tokens = global_batch * s
    flops = training_flops(stage_params(model, ParallelConfig(), 0), tokens, L, s, h) / world
    forward = flops / 3
    extra = {"full": forward, "selective": tokens * 4 * L * s * h / world}.get(recompute, 0.0)
    return Estimate(config, params, states, acts, bubble, per_gpu, m, flops + extra, forward,
                    dp_transfers, held)


def link_of(config: ParallelConfig, kind: str, hardware: Hardware = Hardware()) -> str:
    """Whether the ``kind`` group (tp, pp or dp) fits inside one node ("intra") or not ("inter"):
    Megatron's order puts tp innermost (stride 1), then dp (stride tp), then pp (stride tp dp)."""
    span = {"tp": config.tp, "dp": config.tp * config.dp,
            "pp": config.tp * config.dp * config.pp}[kind]
    size = {"tp": config.tp, "dp": config.dp, "pp": config.pp}[kind]
    return "intra" if size == 1 or span <= hardware.gpus_per_node else "inter"


def step_time(e: Estimate, hardware: Hardware = Hardware()) -> dict:
    """Seconds of one step on one GPU: {"compute", "tp", "pp", "dp", "bubble", "total"}, the
    communication parts being what is exposed (`Hardware.describe` says what overlaps)."""
    c = e.config

    def seconds(nbytes, kind):
        bw = hardware.intra.bandwidth if link_of(c, kind, hardware) == "intra" else hardware.inter_bandwidth
        return nbytes / bw

    m = e.microbatches
    compute = e.flops / hardware.peak_flops
    per_mb = compute / m
    backward = per_mb - e.forward_flops / m / hardware.peak_flops  # recompute runs in backward
    window = {"backward": backward, "micro-batch": per_mb, "": 0.0}
    dp = sum(times * max(0.0, seconds(nbytes, "dp") - window[under])
             for _, nbytes, times, under in e.dp_transfers)
    tp, pp = seconds(e.bytes_per_step["tp"], "tp"), seconds(e.bytes_per_step["pp"], "pp")
    bubble = (compute + tp + pp) * (c.pp - 1) / (c.virtual_stages * m)
    return dict(compute=compute, tp=tp, pp=pp, dp=dp, bubble=bubble,
                total=compute + tp + pp + dp + bubble)
