"""What a parallel configuration costs per GPU, from formulas: memory, bubble, bytes per link.

    e = estimate(GPTConfig(...), ParallelConfig.article_175b(), micro_batch=1, global_batch=1536)
    e.memory_gb, e.fits(80e9), e.bubble, e.bytes_per_step   # per GPU

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
* dp (across nodes): the gradients' all-reduce, 2 (d-1)/d x gradient bytes (ZeRO-1/2: a
  reduce-scatter plus an all-gather of the parameters, the same; ZeRO-3: 1.5 times that).

The course's tests check these formulas against the tiny model's measured parameters and
bytes (`tests/test_parallel_estimate.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from reference.memory import MemoryBytes, Precision, human_bytes, model_state_bytes
from reference.parallel.config import ParallelConfig

__all__ = ["Estimate", "estimate", "block_params", "stage_params", "activation_bytes_per_block"]


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

    @property
    def total_bytes(self) -> float:
        return self.model_states.model_states + self.activations

    @property
    def memory_gb(self) -> float:
        return self.total_bytes / 1e9

    def fits(self, device_bytes: float = 80e9) -> bool:
        return self.total_bytes <= device_bytes

    def table(self) -> str:
        ms = self.model_states
        rows = [("parameters", ms.params), ("gradients", ms.grads),
                ("optimizer state", ms.optimizer_state), ("activations", self.activations),
                ("total", self.total_bytes)]
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
    per_gpu = {
        "tp": blocks_here * m * tp_calls * 2 * (t - 1) / t * S if t > 1 else 0.0,
        # a middle stage sends an activation on and a gradient back per micro-batch; with
        # pp = 2 each end sends one of the two
        "pp": (2 if p > 2 else 1) * m * S / (t if config.sequence_parallel else 1) if p > 1 else 0.0,
        "dp": (2 * (d - 1) / d * params * grad_bytes * (1.5 if config.zero_stage == 3 else 1.0)
               if d > 1 else 0.0),
    }
    return Estimate(config, params, states, acts, bubble, per_gpu)
