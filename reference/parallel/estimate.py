"""What a parallel configuration costs per GPU, from formulas: memory, bubble, bytes per link,
and an estimated step time.

    e = estimate(GPTConfig(...), ParallelConfig.article_175b(), micro_batch=1, global_batch=1536)
    e.memory_gb, e.fits(80e9), e.bubble, e.bytes_per_step   # per GPU
    e.phases                              # composed ZeRO-3: the step's peak by phase
    step_time(e)["total"]                 # seconds, under Hardware()'s assumptions

Memory is that of one pipeline rank, ``stage`` (default 0: the heaviest of a pipeline cut by
layers; with ``embedding_stage`` the next): the tensors it holds and the activations each
micro-batch stores (`reference.parallel.estimate_memory`: the shapes and Korthikanti et al.'s
terms), the gradients and optimizer state by ZeRO's formulas over the dp ranks
(`reference.memory.model_state_bytes`), times the micro-batches the rank holds at its peak.
`Estimate.total_bytes` is the step's peak: for ZeRO 0-2 (and ZeRO-3 by blocks) the model
states plus the stored activations plus what a backward adds beside them (the gradient of the
log-probabilities on the head's stage; with full recompute the stage's forward again, which
this executor recomputes whole at the start of each backward); for composed ZeRO-3 the largest
of its phases, `Estimate.phases` (`zero3_phases`). `tests/test_composed_peak.py` measures the
phases on 8 ranks: the estimate bounds every rank's peak within 10 %; resharding's,
`tests/test_parallel_estimate.py`: above the measured peak by 15 and 22 %.

Bubble: (pp - 1) / (m + pp - 1), m micro-batches per step (interleaved: (pp - 1) / (v m + pp - 1)).
Bytes each GPU sends per step, by link (tp, pp, dp): `reference.parallel.estimate_traffic`.

Step time (`step_time`, under the assumptions `Hardware.describe` lists): the step's training
FLOPs (`reference.profile.training_flops`, recompute included; an MoE layer counts k experts
per token, on every tp rank) over the GPUs at the peak FLOP/s, plus the exposed communication
(all of tp's and pp's: a TP collective's output is the next matmul's input, a stage waits for
its neighbour; of dp's only what outlasts the compute it hides under), plus the bubble,
`idle_share` of the busy time. A link is NVLink when its group fits in one node (`link_of`),
else the GPU's share of the node's NICs."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Optional

from reference.comms.links import GPUS_PER_NODE, NIC, NICS_PER_NODE, NVLINK, Link
from reference.memory import MemoryBytes, Precision, human_bytes, model_state_bytes
from reference.parallel.config import V_SHAPED, ParallelConfig
from reference.parallel.estimate_memory import (activation_bytes_per_block, block_params, chunk_held, held_before_i,
                                                in_flight, mlp_activation_bytes, moe_activation_bytes,
                                                rank_specs, split_held, stage_params, stage_tensors,
                                                zero3_phases)
from reference.parallel.estimate_traffic import dp_transfers, tp_bytes, transfer_link
from reference.pipeline_parallel import (ZB_KINDS, build_schedule, held_bytes_per_block,
                                         zero_bubble_formula)
from reference.profile import training_flops

__all__ = ["Estimate", "Workload", "estimate", "block_params", "stage_params", "activation_bytes_per_block",
           "Hardware", "H100_BF16_PEAK", "step_time", "link_of", "idle_share"]

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
                f"bubble (pp-1)/(v m) of the busy time (zero-bubble: idle_share); latency left out")


@dataclass
class Estimate:
    config: ParallelConfig
    params_per_gpu: int
    model_states: MemoryBytes
    activations: float                # stored at the rank's peak (micro-batches in flight)
    bubble: float
    bytes_per_step: dict = field(default_factory=dict)  # link -> bytes one GPU sends per step
    microbatches: int = 1             # m per step (accumulation when pp = 1)
    flops: float = 0.0                # training FLOPs one GPU computes per step, recompute included
    forward_flops: float = 0.0        # of which the first forward's
    # dp's transfers: (what, bytes each, times per step, hides under "backward" / "micro-batch" / "")
    dp_transfers: tuple = ()
    held_in_step: float = 0.0         # composed ZeRO-3: the stage's parameters and gradients whole
    phases: dict = field(default_factory=dict)  # the step's peak by phase (bytes)
    stage: int = 0                    # the pipeline rank modelled
    expert_params: int = 0            # of params_per_gpu, the experts' (sharded over dp / ep)

    @property
    def total_bytes(self) -> float:
        """The step's peak per GPU: the largest of its phases."""
        return max(self.phases.values())

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
        if len(self.phases) > 1:
            rows += [(f"peak in {name}", v) for name, v in self.phases.items()]
        rows.append(("peak of the step", self.total_bytes))
        out = [f"{self.config} (pipeline rank {self.stage}): "
               f"{self.params_per_gpu / 1e9:.2f}B parameters per GPU"]
        out += [f"  {name:<20} {human_bytes(v):>10}" for name, v in rows]
        out.append(f"  bubble {self.bubble:.1%}; bytes sent per step: " + ", ".join(
            f"{k} {human_bytes(v)}" for k, v in self.bytes_per_step.items()))
        return "\n".join(out)


@dataclass(frozen=True)
class Workload:
    """What `estimate` models: the model (a `GPTConfig`) under ``config`` on pipeline rank
    ``stage``, the batch, and how the step stores its numbers; a field left None is resolved
    from the configuration once, so every part of the estimate reads the same values."""

    model: object
    config: ParallelConfig
    micro_batch: int                  # b sequences per micro-batch per dp rank
    global_batch: int                 # sequences per step: m = global_batch / (dp b)
    seq_len: Optional[int] = None     # default: the model's block size
    precision: Optional[Precision] = None  # default: fp32 Adam, or mixed precision
    act_bytes: Optional[int] = None   # per activation; default 4 in fp32, else 2
    grad_bytes: Optional[int] = None  # per gradient sent; default the precision's
    recompute: Optional[str] = None   # "none", "selective", "full"; default full when checkpointing
    stage: int = 0
    n_experts: Optional[int] = None   # experts per MoE layer, each token routed to k
    moe_layers: Optional[tuple] = None  # which layers are MoE (default all)
    k: int = 2
    attention: str = "unfused"        # the paper's stored scores, or "fused"
    # under SP, whether a column-parallel layer keeps only its input's shard and all-gathers it
    # again in backward (Megatron's form, what Korthikanti's sbh/t terms store); default: with SP
    regather_input: Optional[bool] = None

    def __post_init__(self):
        c = self.config
        if c.cp > 1:  # its activations (T / cp per rank) and ring traffic are not modelled here
            raise ValueError(f"estimate models dp, tp, pp and ep: cp={c.cp} ({c}) is not in its "
                             f"formulas (see reference.context_parallel.cost for context parallelism's)")
        if not 0 <= self.stage < c.pp:
            raise ValueError(f"stage={self.stage} is not a pipeline rank of pp={c.pp}")
        if self.global_batch % (c.dp * self.micro_batch):
            raise ValueError(f"global_batch={self.global_batch} is not a multiple of dp={c.dp} x "
                             f"micro_batch={self.micro_batch}")
        precision = self.precision or (Precision.fp32_adam() if c.precision == "fp32" else Precision.mixed_adam())
        resolved = dict(precision=precision, seq_len=self.seq_len or self.model.block_size,
                        grad_bytes=precision.grad if self.grad_bytes is None else self.grad_bytes,
                        act_bytes=self.act_bytes or (4 if c.precision == "fp32" else 2),
                        recompute=self.recompute or ("full" if c.activation_checkpointing else "none"),
                        regather_input=(c.sequence_parallel and c.tp > 1 if self.regather_input is None
                                        else self.regather_input))
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    @property
    def m(self) -> int:
        """Micro-batches per step (accumulation when pp = 1)."""
        return self.global_batch // (self.config.dp * self.micro_batch)

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter an all-gather of the parameters sends (the precision's, bf16 under
        Megatron's distributed optimizer while its gradients are reduced in fp32)."""
        return self.precision.param

    @property
    def activation(self) -> float:
        """S: the bytes of one activation of one micro-batch, b s h."""
        return self.seq_len * self.micro_batch * self.model.n_embd * self.act_bytes

    @property
    def tensors(self):
        """Every tensor one GPU of the stage holds (`estimate_memory.stage_tensors`)."""
        return stage_tensors(self.model, self.config, self.stage, self.n_experts, self.moe_layers)

    @property
    def blocks(self) -> set:
        return set(self.tensors.units()) - {"root"}

    @property
    def moe_blocks(self) -> set:
        return set(self.tensors.of(True).units())

    @cached_property
    def moe(self) -> frozenset:
        """The layers that are MoE (every one by default; none without experts)."""
        layers = range(self.model.n_layer) if self.moe_layers is None else self.moe_layers
        return frozenset(layers) if self.n_experts else frozenset()

    def holds(self, part: str) -> bool:
        """Whether the stage holds the "embedding" or the "head"."""
        return any(getattr(spec, part) for spec in rank_specs(self.model, self.config, self.stage))

    @property
    def composed(self) -> bool:
        """ZeRO-3 composed (`ShardedParameters`): the stage gathered once per step."""
        c = self.config
        return c.zero_stage == 3 and c.dp > 1 and not c.zero3_by_blocks

    @property
    def reshard(self) -> bool:
        return getattr(self.config, "reshard_after_forward", False)


def estimate(model, config: ParallelConfig, **workload) -> Estimate:
    """Memory per GPU of pipeline rank ``stage``, the bubble and bytes per step per link, of
    ``Workload(model, config, **workload)`` (its fields say what each option means)."""
    if config.schedule == "dualpipe" and config.pp > 1:
        raise ValueError("the estimate does not count DualPipe's two copies of every stage yet (twice the "
                         "parameters, PP + 1 micro-batches held: reference.pipeline_parallel.dualpipe); "
                         "estimate schedule='dualpipev' for its time and activations")
    w = Workload(model, config, **workload)
    c, m = w.config, w.m
    t, p = c.tp, c.pp
    a1, work, first, later = activations(w)
    acts = held_activations(w, a1)
    states, phases, held = model_states(w, a1, first, later, work, acts)
    per_gpu = {"tp": tp_bytes(w) if t > 1 else 0.0,
               "pp": pp_sends(w) * m * w.activation / (t if c.sequence_parallel and t > 1 else 1)
               if p > 1 else 0.0}
    transfers = dp_transfers(w)
    for kind in ("dp",) + (("dp_replicate",) if c.dp_replicate > 1 else ()):
        per_gpu[kind] = sum(nbytes * times for what, nbytes, times, _ in transfers if transfer_link(what) == kind)
    flops, forward = training_flops_per_gpu(w)
    tensors = w.tensors
    idle = idle_share(c, m)
    return Estimate(c, tensors.sizes()[0], states, acts, idle / (1 + idle), per_gpu, m,
                    flops, forward, transfers, held, phases, w.stage, tensors.of(True).sizes()[0])


def pp_sends(w: Workload) -> int:
    """Tensors the rank sends per micro-batch (each sequence-split under SP): every stage it holds
    sends its activation on unless it is the last, and its input's gradient back unless it is the
    first, when the neighbouring stage sits on another rank. The first rank of a plain pipeline
    sends activations only, a middle one both."""
    mine = {spec.stage for spec in rank_specs(w.model, w.config, w.stage)}
    last = w.config.n_stages - 1
    return sum((s < last and s + 1 not in mine) + (s > 0 and s - 1 not in mine) for s in mine)


def idle_share(c: ParallelConfig, m: int) -> float:
    """The pipeline's idle time over its busy time: (p - 1) / (v m) for GPipe, 1F1B and
    interleaved 1F1B; for the zero-bubble schedules their closed form with F = I = W (Qi et
    al.'s assumption; `zero_bubble_formula`): (p - 1) / (3 m) for ZB-H1, (p - 1) / (6 m) for
    ZB-V from m >= 2p - 1 and DualPipeV (below it, their simulated timeline)."""
    if c.pp == 1:
        return 0.0
    if c.schedule in ZB_KINDS:
        try:
            share = zero_bubble_formula(c.schedule, c.pp, m)
        except ValueError:  # outside the closed form's range: simulate the schedule
            share = build_schedule(c.schedule, c.pp, m, c.virtual_stages).bubble_fraction()
        return share / (1 - share)
    return (c.pp - 1) / (c.virtual_stages * m)


def held_for_w(w: Workload, specs: Optional[tuple] = None) -> float:
    """What one micro-batch holds on the rank's stages ``specs`` (default all; or one chunk's)
    from its I to its W under a zero-bubble schedule, in place of what its F stored: each linear
    layer's X and dY (`held_bytes_per_block`), on every stage; the embedding's and the head's
    gradients are computed in I, and a checkpointed forward run again in I is freed by it."""
    model, c = w.model, w.config
    s, b, h, t = w.seq_len, w.micro_batch, model.n_embd, c.tp
    specs = rank_specs(model, c, w.stage) if specs is None else specs
    layers = [i for spec in specs for i in spec.layers]
    n_moe = sum(i in w.moe for i in layers)
    return sum(n * held_bytes_per_block(s, b, h, t, c.sequence_parallel, w.act_bytes, model.d_ff,
                                        n_experts=experts, k=w.k, bias=model.bias)
               for n, experts in ((len(layers) - n_moe, None), (n_moe, w.n_experts)) if n)


def logprob_bytes(w: Workload) -> float:
    """The loss's fp32 log-probabilities of one micro-batch, (s b, V_pad / tp)."""
    return 4 * w.seq_len * w.micro_batch * -(-w.model.vocab_size // w.config.tp)


def stored_per_f(w: Workload, specs: tuple) -> float:
    """`activations`' a1 over the stages ``specs`` (one chunk's) alone."""
    stored = sum(block_bytes(w, w.recompute, i in w.moe) for spec in specs for i in spec.layers)
    head = any(spec.head for spec in specs) and w.recompute != "full"
    return stored + head * logprob_bytes(w)


def held_activations(w: Workload, a1: float) -> float:
    """The activation bytes at the rank's peak: the largest F-bytes x micro-batches held from F
    to I plus I-bytes x those held from I to W, over `split_held`'s candidates (a V-shaped
    schedule's rank: over `chunk_held`'s, each chunk with its own bytes, which may differ); with
    full recomputation, or where an I starts (`held_before_i`) with a chunk's forward run again."""
    c = w.config
    again = 0.0
    if c.schedule in ZB_KINDS and c.pp > 1 and w.recompute == "full":
        whole = max(stored_per_f(replace(w, recompute="none"), (spec,)) for spec in rank_specs(w.model, c, w.stage))
        again = max(f * a1 + i * held_for_w(w) for f, i in held_before_i(c, w.m, w.stage)) + whole
    if c.schedule in V_SHAPED and c.pp > 1:
        counts = chunk_held(c, w.m, w.stage)
        if counts:
            chunks = [(spec,) for spec in rank_specs(w.model, c, w.stage)]
            f = [stored_per_f(w, chunk) for chunk in chunks]
            i = [held_for_w(w, chunk) for chunk in chunks]
            return max(again, max(n[0] * f[0] + n[1] * f[1] + n[2] * i[0] + n[3] * i[1] for n in counts))
    return max(again, max(f * a1 + i * held_for_w(w) for f, i in split_held(c, w.m, w.stage)))


def block_bytes(w: Workload, kind: str, moe: bool) -> float:
    """What one block stores for one micro-batch under recompute ``kind`` (Korthikanti's terms,
    `activation_bytes_per_block`), an MoE block what it routes in the MLP's place."""
    model, c = w.model, w.config
    s, b, h, t = w.seq_len, w.micro_batch, model.n_embd, c.tp
    x = activation_bytes_per_block(s, b, h, model.n_head, t, c.sequence_parallel, kind,
                                   act_bytes=w.act_bytes, d_ff=model.d_ff, attention=w.attention)
    # full recompute keeps the block's input alone, MoE or not; no experts, no MoE block (n = 0)
    if moe and kind != "full" and w.n_experts:
        x += (moe_activation_bytes(s, b, h, model.d_ff, w.k, w.act_bytes, n_experts=w.n_experts)
              - mlp_activation_bytes(s, b, h, model.d_ff, t, c.sequence_parallel, w.act_bytes))
    return x


def activations(w: Workload) -> tuple:
    """(a1, work, first, later): the bytes one micro-batch leaves stored, what a backward adds
    beside them, and the micro-batches in flight at the first and later backwards (`in_flight`)."""
    c, recompute = w.config, w.recompute
    n_blocks, n_moe = len(w.blocks), len(w.moe_blocks)
    stored = (n_blocks - n_moe) * block_bytes(w, recompute, False) + n_moe * block_bytes(w, recompute, True)
    whole = (n_blocks - n_moe) * block_bytes(w, "none", False) + n_moe * block_bytes(w, "none", True)
    logprobs = logprob_bytes(w) if w.holds("head") else 0.0
    a1 = stored + (0.0 if recompute == "full" else logprobs)
    # the gradient of the log-probabilities and the softmax it comes from; with recompute the
    # stage's forward again (this executor recomputes a whole chunk at the start of its B)
    work = 2 * logprobs + {"full": (whole + logprobs) / c.virtual_stages,
                           "selective": (whole - stored) / c.virtual_stages}.get(recompute, 0.0)
    first, later, _ = in_flight(c, w.m, w.stage)
    return a1, work, first, later


def model_states(w: Workload, a1, first, later, work, acts) -> tuple:
    """(`MemoryBytes` of the model states, the step's peak by phase, bytes held whole in the
    step): ZeRO's formulas over dp, or composed ZeRO-3's shards and phases (`zero3_phases`)."""
    c, precision, tensors = w.config, w.precision, w.tensors
    if not w.composed:
        states = model_state_bytes(tensors.sizes()[0], c.dp, c.zero_stage, precision)
        return states, {"step": states.model_states + acts + work}, 0.0
    d = c.dp
    sets = [(tensors.of(False), d), (tensors.of(True), d // c.ep)] if c.ep > 1 else [(tensors, d // c.dp_replicate)]
    sets = [(ts, n) for ts, n in sets if ts]
    shard = sum(ts.sizes(n)[1] for ts, n in sets)
    states = MemoryBytes(precision.param * shard, precision.grad * shard, precision.optimizer * shard)
    phases, held = zero3_phases(sets, precision, a1, first, later, work, w.holds("head"), w.reshard,
                                w.recompute == "full")
    return states, phases, held


def training_flops_per_gpu(w: Workload) -> tuple[float, float]:
    """(FLOPs one GPU computes per step, recompute included; the first forward's of them): the
    whole model's over every GPU (tokens split by dp, weights by tp and pp); an expert's over
    dp and pp only (every tp rank runs the experts on the whole sequence)."""
    model, c, s = w.model, w.config, w.seq_len
    L, h = model.n_layer, model.n_embd
    world = c.dp * c.tp * c.pp
    tokens = w.global_batch * s
    one = stage_tensors(model, ParallelConfig(), 0, w.k if w.n_experts else None, w.moe_layers)
    active, active_experts = one.of(False).sizes()[0], one.of(True).sizes()[0]  # k experts a layer
    flops = training_flops(active, tokens, L, s, h) / world + 6 * tokens * active_experts / (c.dp * c.pp)
    forward = flops / 3
    extra = {"full": forward, "selective": tokens * 4 * L * s * h / world}.get(w.recompute, 0.0)
    return flops + extra, forward


def link_of(config: ParallelConfig, kind: str, hardware: Hardware = Hardware()) -> str:
    """Whether the ``kind`` group (tp, pp, dp or dp_replicate) fits inside one node ("intra") or
    not ("inter") in Megatron's order: tp innermost, then dp, then pp. Under HSDP "dp" is the
    group ZeRO-3 shards over and "dp_replicate" the replicas across such groups."""
    shard = config.dp // config.dp_replicate
    span = {"tp": config.tp, "dp": config.tp * shard, "dp_replicate": config.tp * config.dp,
            "pp": config.tp * config.dp * config.pp}[kind]
    size = {"tp": config.tp, "dp": shard, "dp_replicate": config.dp_replicate, "pp": config.pp}[kind]
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
    dp = sum(times * max(0.0, seconds(nbytes, transfer_link(what)) - window[under])
             for what, nbytes, times, under in e.dp_transfers)
    tp, pp = seconds(e.bytes_per_step["tp"], "tp"), seconds(e.bytes_per_step["pp"], "pp")
    bubble = (compute + tp + pp) * idle_share(c, m)
    return dict(compute=compute, tp=tp, pp=pp, dp=dp, bubble=bubble,
                total=compute + tp + pp + dp + bubble)
