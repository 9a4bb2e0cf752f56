"""`describe(config, world_size)`: what a trainer configuration means on that many ranks.

The trainer's `--check` prints it: the layout, the batch, what ZeRO shards, the precision, the
optimizer and schedule; then what is inconsistent (what `TrainConfig.parallel_config` refuses)
or pointless (ZeRO at dp 1, DeepSpeed keys that do nothing here, ...). It never raises, and
reads the configuration through its attributes only (`reference.train.config` imports it).
"""
from __future__ import annotations

from reference.parallel.config import ParallelConfig
from reference.train.deepspeed_blocks import OFFLOAD_REFUSED

__all__ = ["describe", "LARGE_MICRO_BATCH"]

# Sequences in one micro-batch above which describe warns: the course's models run a few dozen at
# most; hundreds per GPU means a batch sized for many more data-parallel ranks than this world has.
LARGE_MICRO_BATCH = 64

_ZERO_SHARDS = {0: "nothing (plain data parallelism: each dp rank holds every model state)",
                1: "the optimizer state (P_os)", 2: "the optimizer state and the gradients (P_os+g)",
                3: "the optimizer state, the gradients and the parameters (P_os+g+p)"}
_NO_EFFECT = {"zero_optimization": ("overlap_comm", "contiguous_gradients", "reduce_scatter",
                                     "reduce_bucket_size", "allgather_bucket_size"),
              "fp16": ("auto_cast",),
              "activation_checkpointing": ("cpu_checkpointing", "contiguous_memory_optimization",
                                           "number_checkpoints", "synchronize_checkpoint_boundary",
                                           "profile"),
              "": ("steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer")}


def _try(issues: list, fn):
    try:
        return fn()
    except ValueError as e:
        issues.append(str(e))
        return None


def _gate(e) -> str:
    """What the experts block's router keys mean, in words."""
    gate = ("sigmoid gate (DeepSeek-V3: scores sigmoid(u . e_i), weights normalised over the "
            "chosen)" if e.score_function == "sigmoid" else "softmax gate (Switch, GShard)")
    loss = f"balance loss x {e.balance_coef:g} per sequence"
    if not e.enable_expert_bias:
        return f"{gate}, {loss}"
    return (f"{gate}, {loss}; loss-free balancing: a per-expert bias added to the scores only to "
            f"choose, moved by {e.bias_update_rate:g} x sign(mean load - load) after each step, "
            f"from the step's loads over dp (saved in checkpoints)")


def describe(config, world_size: int) -> str:
    p, issues = config.parallelism, []
    tp, pp, ep, v = p.tensor, p.pipeline, p.expert, p.virtual_stages
    dp = config.dp(world_size)
    out = [f"{config.path or 'configuration'} on {world_size} ranks"
           + (f": {config.about}" if config.about else "")]

    def line(key, text):
        out.append(f"  {key:<11}{text}")

    fits = dp * tp * pp == world_size
    line("layout", f"world {world_size} {'=' if fits else '!='} dp {dp} x tp {tp} x pp {pp}"
         + (f", ep {ep} inside dp (edp {dp // ep if dp % ep == 0 else '?'})" if ep > 1 else "")
         + ("; sequence parallel over tp" if p.sequence_parallel and tp > 1 else ""))
    cfg = _try(issues, config.gpt_config)
    batch = _try(issues, lambda: config.batch_sizes(world_size))
    T = config.data.seq_len or (cfg.block_size if cfg else None)
    if cfg:
        per_stage = cfg.n_layer / (pp * v)
        e = config.model.experts
        per_rank = (e.num_experts // ep if e.num_experts % ep == 0 else "?") if e else None
        line("model", f"{config.model.preset or 'GPTConfig'}: {cfg.n_layer} layers, C {cfg.n_embd}, "
             f"{cfg.n_head} heads, block {cfg.block_size}, vocab {cfg.vocab_size}"
             + (f"; {e.num_experts} experts top-{e.top_k} per layer ({per_rank} per ep rank)" if e else "")
             + (f"; {_gate(e)}" if e else "")
             + (f"; {per_stage:g} layer{'' if per_stage == 1 else 's'} per stage" if pp > 1 else ""))
        if cfg.vocab_size < 256 and config.data.source != "synthetic":
            issues.append(f"data.source={config.data.source!r} is bytes (256 token ids) but "
                          f"vocab_size={cfg.vocab_size}")
    if batch:
        _batch_lines(config, line, issues, batch, T, dp)
    _zero_lines(config, line, issues, dp, fits, world_size)
    _precision_line(config, line)
    _optimizer_lines(config, line, issues)
    _run_lines(config, line, issues, tp)
    _refusals(config, issues, world_size)
    out.append("inconsistent or pointless:" if issues else "inconsistent or pointless: nothing found")
    out += [f"  - {i}" for i in issues]
    return "\n".join(out)


def _batch_lines(config, line, issues, batch, T, dp):
    """The batch, the loss's mean, the pipeline's bubble and post-validation."""
    p = config.parallelism
    pp, v = p.pipeline, p.virtual_stages
    B, mb, acc = batch
    tokens = f"; {B * T:,} tokens per step ({B} sequences x {T})" if T else ""
    line("batch", f"train_batch_size {B} = micro-batch {mb} x accumulation {acc} x dp {dp}{tokens}")
    line("loss", "the mean over the step's counted tokens, as one process (reference.loss)"
         if p.loss_mean == "tokens" else "each micro-batch's mean, averaged (mean_of_means)")
    if p.loss_mean == "mean_of_means" and config.data.source == "documents":
        issues.append("parallelism.loss_mean='mean_of_means' on padded documents: micro-batches "
                      "and ranks count different numbers of tokens, so the average of their means "
                      "is not one process's loss; use 'tokens'")
    if pp > 1:
        m, bubble = acc, (pp - 1) / (v * acc + pp - 1)
        line("pipeline", f"{p.schedule} over {m} micro-batches (DeepSpeed's accumulation steps)"
             + (f", {v} chunks per rank" if v > 1 else "")
             + f": bubble (p-1)/({'v' if v > 1 else ''}m+p-1) = {bubble:.0%} of the step")
        if p.schedule == "dualpipe":
            line("", "dualpipe: half the micro-batches fed from each end of the pipeline; each rank holds "
                     "stage r and a copy of stage pp - 1 - r (twice 1F1B's parameters), the copies' "
                     "gradients summed after the backward (reference.pipeline_parallel.dualpipe)")
    if pp > 1 and p.schedule in ("dualpipev", "dualpipe"):
        line("", "overlap_forward_backward: " + (
            "each F&B pair's forward and backward in turns, one micro-batch's expert all-to-all in "
            "flight while the other computes (DeepSeek-V3, section 3.2.1)" if p.overlap_forward_backward
            else "off: each F&B pair's forward, then its backward"))
    if p.optimizer_post_validation:
        line("", "optimizer_post_validation: each rank steps at once; the clip norm and fp16's "
                 "overflow test complete after, and a step that fails them is undone from an exact "
                 "copy on every rank (and redone clipped), as Qi et al. (2024, section 4) describe")
    if mb > LARGE_MICRO_BATCH:
        issues.append(f"a batch of {B} in {acc} accumulation steps at dp {dp} is a micro-batch "
                      f"of {mb} sequences per GPU"
                      + (f" ({mb * T:,} tokens in one forward)" if T else "")
                      + f": train_batch_size counts every data-parallel rank, and here only {dp} "
                      f"share{'s' if dp == 1 else ''} it; raise gradient_accumulation_steps or "
                      f"lower train_batch_size")


def _zero_lines(config, line, issues, dp, fits, world_size):
    """ZeRO's stage, what it shards over how many ranks, offload and resharding."""
    p, z = config.parallelism, config.zero_optimization
    tp, pp = p.tensor, p.pipeline
    offload = z.offload_optimizer.device if z.offload else None
    line("ZeRO", f"stage {z.stage} at dp {dp}: shards {_ZERO_SHARDS[z.stage]}"
         + (f" over {dp} rank{'s' if dp > 1 else ''}" if z.stage else "")
         + (f"; offload_optimizer to {offload}: refused (nothing is offloaded here)" if offload else ""))
    engine = ParallelConfig(dp=dp, tp=tp, pp=pp, ep=p.expert, zero_stage=z.stage,
                            zero3_engine=p.zero3_engine).zero3_engine_used if fits else None
    if engine == "blocks":
        line("", f"ZeRO-3 engine: FSDP by blocks (zero3_engine={p.zero3_engine!r}): each block gathered "
                 f"for every micro-batch's forward and backward, its gradient reduce-scattered then "
                 f"(about 3 m collectives a step)")
    elif engine == "parameters":
        line("", f"ZeRO-3 engine: each parameter's rows (zero3_engine={p.zero3_engine!r}): gathered "
                 f"once a step and reduce-scattered once (2 collectives a step)")
    if p.reshard_after_forward:
        line("", "reshard_after_forward: each block gathered for its forward and again for its "
                 "backward, its gradients reduce-scattered after every micro-batch (3 m transfers "
                 "a step for less memory; the course's default is false, PyTorch's fully_shard's "
                 "None: true for every module but the root)")
    if offload:
        issues.append(OFFLOAD_REFUSED.format(device=offload))
    if z.stage and dp == 1 and fits:
        issues.append(f"dp is 1, so ZeRO-{z.stage} shards nothing: it splits "
                      f"{_ZERO_SHARDS[z.stage].split(' (')[0]} over the data-parallel ranks, and "
                      f"there is one (world {world_size} = tp {tp} x pp {pp})")
    if offload and z.stage == 0:
        issues.append("zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 "
                      "(DeepSpeed's rule): at stage 0 it does nothing")


def _precision_line(config, line):
    """fp16's loss scaling as DeepSpeed's keys set it, or bf16 / fp32."""
    f16 = config.fp16
    if config.precision == "fp16":
        scaling = (f"a fixed loss scale {f16.loss_scale:g}" if f16.loss_scale else
                   f"dynamic loss scaling from 2^{f16.initial_scale_power} = "
                   f"{2 ** f16.initial_scale_power:g}, x2 every {f16.loss_scale_window} steps "
                   f"without overflow; hysteresis {f16.hysteresis}: /2 from the "
                   f"{_ordinal(f16.hysteresis)} overflow "
                   + ("in a row on (consecutive_hysteresis)" if f16.consecutive_hysteresis else
                      "since the scale last grew on (DeepSpeed's default, "
                      "consecutive_hysteresis false)")
                   + f", never below {f16.min_loss_scale:g}; an overflowing step is skipped and "
                   f"does not advance the schedule")
        line("precision", f"fp16 with {scaling}")
    else:
        line("precision", f"{config.precision}: no loss scaling"
             + (" (bf16 keeps fp32's exponent range)" if config.precision == "bf16" else ""))


def _refusals(config, issues, world_size):
    """What ParallelConfig refuses at this world size, in DeepSpeed's terms where it refuses too."""
    z, pp = config.zero_optimization, config.parallelism.pipeline
    try:
        config.parallel_config(world_size)
    except ValueError as e:      # "<file> at world_size=W: <message>": keep the message
        text = str(e).split(f"world_size={world_size}: ", 1)[-1]
        items = text.split("\n  - ")  # ParallelConfig.validate's list, one reason an item
        for item in (items[1:] if len(items) > 1 else items):
            if item.startswith("zero_stage=") and "pp=" in item:
                issues.append(f"ZeRO-{z.stage} with pipeline {pp}: DeepSpeed's pipeline engine "
                              f"refuses ZeRO-2 and 3, and ParallelConfig refuses ZeRO-2 ({item})")
            elif item.startswith("zero_stage=") and " with ep=" in item:
                issues.append(f"ZeRO-{z.stage} with expert parallelism: DeepSpeed partitions expert "
                              f"parameters in groups of their own over the expert-data-parallel "
                              f"ranks; this trainer does not, and refuses ({item})")
            elif not any(item in known for known in issues):
                issues.append(f"ParallelConfig: {item}" if len(items) > 1 else item)
    if z.stage == 2 and pp > 1 and not any("pipeline engine" in i for i in issues):
        issues.append(f"ZeRO-2 with pipeline {pp}: DeepSpeed's pipeline engine refuses ZeRO-2 and 3, "
                      f"and ParallelConfig refuses ZeRO-2: it would reduce-scatter once per "
                      f"micro-batch; use stage 0, 1 or 3 with a pipeline")
    if z.stage == 3 and pp > 1:
        issues.append(f"ZeRO-3 with pipeline {pp}: DeepSpeed's pipeline engine refuses ZeRO-2 and 3; "
                      f"this trainer differs and runs it as torchtitan does (each parameter sharded "
                      f"over dp, a stage gathered once per step and kept whole through its "
                      f"micro-batches: memory for traffic)")


def _ordinal(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


def _optimizer_lines(config, line, issues):
    o, s = config.optimizer, config.scheduler
    kwargs = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in o.kwargs().items())
    clip = f"clip the global norm at {config.gradient_clipping:g}" if config.gradient_clipping else "no clipping"
    line("optimizer", f"{o.type} (torch.optim.{o.torch_class().__name__}"
         + (f": {kwargs}" if kwargs else ", torch's defaults") + f"); {clip}")
    if o.params.weight_decay is None:
        line("", "weight_decay unset: DeepSpeed's default 0 (torch.optim.AdamW's own default "
                 "would be 0.01), applied to every parameter")
    if s is None:
        line("schedule", "constant lr")
        return
    r = s.resolved(o.params.lr if o.params.lr is not None else 1e-3, config.steps)
    if s.type == "WarmupCosineLR":
        text = (f"x{r['warmup_min_ratio']:g} -> x1 over {r['warmup_num_steps']} steps ({r['warmup_type']}), "
                f"cosine to x{r['cos_min_ratio']:g} at step {r['total_num_steps']}")
    else:
        text = (f"{r['warmup_min_lr']:g} -> {r['warmup_max_lr']:g} over {r['warmup_num_steps']} "
                f"steps ({r['warmup_type']}), then "
                + ("constant" if s.type == "WarmupLR" else f"linear to 0 at step {r['total_num_steps']}"))
    line("schedule", f"{s.type}: {text}")
    if s.type != "WarmupCosineLR" and s.params.warmup_max_lr is None and o.params.lr is not None \
            and o.params.lr != r["warmup_max_lr"]:
        issues.append(f"scheduler.params.warmup_max_lr unset: DeepSpeed's default "
                      f"{r['warmup_max_lr']:g} is the peak lr, not optimizer.params.lr="
                      f"{o.params.lr:g} (the schedule sets the lr outright)")
    if r["warmup_num_steps"] >= config.steps:
        issues.append(f"scheduler.params.warmup_num_steps={r['warmup_num_steps']} >= steps="
                      f"{config.steps}: the run ends inside the warm-up")
    total = r.get("total_num_steps")
    if total is not None and total != config.steps:
        issues.append(f"scheduler.params.total_num_steps={total} but steps={config.steps}: the "
                      f"schedule {'is cut before its end' if total > config.steps else 'ends early'}")


def _run_lines(config, line, issues, tp):
    ac, p, d, ck, lg = (config.activation_checkpointing, config.parallelism, config.data,
                        config.checkpoint, config.log)
    line("memory", "activation checkpointing: each block's forward is recomputed in backward "
         "(here the activation_checkpointing block turns it on; in DeepSpeed the block tunes the "
         "checkpoints the model's code asks for)" if ac.enabled else "no activation checkpointing")
    if p.sequence_parallel and tp == 1:
        issues.append("parallelism.sequence_parallel with tensor=1: no effect (it splits the "
                      "sequence over the tp ranks)")
    if ac.partition_activations:
        issues.append("activation_checkpointing.partition_activations: no effect here"
                      + ("; at tensor=1 there is nothing to partition over" if tp == 1 else
                         "; parallelism.sequence_parallel is what splits each block's activations over tp"))
    for block, key in ((block, key) for block, keys in _NO_EFFECT.items() for key in keys):
        value = getattr(getattr(config, block) if block else config, key)
        if value not in (None, False):
            issues.append(f"{block + '.' if block else ''}{key}={value!r}: DeepSpeed's, no effect here")
    line("run", f"{config.steps} steps, seed {config.seed}; data {d.source} (seed {d.seed}"
         + (f", seq_len {d.seq_len}" if d.seq_len else "") + ")")
    line("checkpoint", (f"{ck.dir}, " + (f"every {ck.every} steps" if ck.every else "at the end")
          if ck.dir else "none")
         + ("; resume from the latest one when there is one (checkpoint.resume)" if ck.resume else ""))
    every = f"every {lg.every} step{'s' if lg.every > 1 else ''}"
    line("log", f"{lg.path} (JSONL) {every}" if lg.path else f"stdout {every}")
    if ck.dir is None and (ck.every or ck.resume):
        issues.append(f"checkpoint.every={ck.every}, resume={ck.resume} without checkpoint.dir: "
                      f"nothing is saved or read")
    if ck.every > config.steps:
        issues.append(f"checkpoint.every={ck.every} > steps={config.steps}: only the end is saved")
    if lg.every > config.steps:
        issues.append(f"log.every={lg.every} > steps={config.steps}: no step is logged")
