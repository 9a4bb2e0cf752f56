"""The trainer's JSON configuration: DeepSpeed's keys and meanings, plus the course's blocks.

    config = load_config("configs/debug_3d.json", {"optimizer.params.lr": "1e-3"})
    pc = config.parallel_config(8)          # a validated ParallelConfig, dp = 8 / (tp x pp)
    print(describe(config, 8))              # what it means on 8 ranks, and what is pointless

DeepSpeed's keys (`deepspeed_blocks`, `lr_schedules`) mean what its docs/config-json says:
`train_batch_size` = `train_micro_batch_size_per_gpu` x `gradient_accumulation_steps` x dp, any
two giving the third; `zero_optimization.offload_optimizer` is refused with its reason (nothing
is offloaded here). Unset keys take DeepSpeed's defaults, where they differ from torch's too:
`weight_decay` 0 (torch's AdamW: 0.01), WarmupLR's `warmup_max_lr` 0.001 (not the optimizer's
lr). Two choices where DeepSpeed leaves the reader guessing:

* optimizer "Adam" is DeepSpeed's: its `adam_w_mode` defaults to true, which is decoupled
  weight decay, i.e. torch's AdamW; `"adam_w_mode": false` gives torch's Adam;
* DeepSpeed's `activation_checkpointing` block tunes checkpoints the model code asks for. Here
  the block itself turns checkpointing of every block on, unless it says `"enabled": false`
  (`true` / `false` alone work too). `partition_activations` and the CPU and memory options are
  accepted and reported by `describe` as having no effect.

The course's own blocks are the dataclasses below; dp is what the world size leaves, and the
pipeline's micro-batches are DeepSpeed's accumulation steps. Keys starting with "_" are comments
("_about" says what a file is). Every error is a ValueError naming the dotted key and its value.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Union

from reference.expert_parallel.router import SCORE_FUNCTIONS
from reference.loss import LOSS_MEANS
from reference.model import GPTConfig
from reference.parallel.config import SCHEDULES, ZERO3_ENGINES, ParallelConfig
from reference.train.deepspeed_blocks import (OFFLOAD_REFUSED, ActivationCheckpointingConfig,
                                              BF16Config, FP16Config, OffloadConfig, OptimizerConfig,
                                              OptimizerParams, ZeroConfig)
from reference.train.describe import describe
from reference.train.jsonconfig import build, parse_value, set_dotted, spec
from reference.train.lr_schedules import SCHEDULERS, SchedulerConfig, make_scheduler

__all__ = ["TrainConfig", "OptimizerConfig", "OptimizerParams", "SchedulerConfig", "FP16Config",
           "BF16Config", "OffloadConfig", "ZeroConfig", "ActivationCheckpointingConfig",
           "ParallelismConfig", "ExpertsConfig", "ModelConfig", "DataConfig", "CheckpointConfig",
           "LogConfig", "load_config", "make_scheduler", "describe", "parse_value", "SCHEDULERS"]


@dataclass
class ParallelismConfig:
    tensor: int = spec(1, min=1)
    pipeline: int = spec(1, min=1)
    expert: int = spec(1, min=1)
    sequence_parallel: bool = False
    virtual_stages: int = spec(1, min=1)
    schedule: str = spec("1f1b", choices=SCHEDULES)
    embedding_stage: bool = False
    # composed ZeRO-3's FSDP2 option: False here, where PyTorch's fully_shard defaults to None
    # (True for every module but the root)
    reshard_after_forward: bool = False
    # ZeRO-3's engine (ParallelConfig.zero3_engine): "auto", "blocks" (FSDP by blocks) or "parameters"
    zero3_engine: str = spec("auto", choices=ZERO3_ENGINES)
    # reference.loss: "tokens" (one process's loss: the sum over counted tokens / their count)
    loss_mean: str = spec("tokens", choices=LOSS_MEANS)
    # Qi et al.'s optimizer post-validation (reference.parallel.post_validation); not DeepSpeed's
    optimizer_post_validation: bool = False
    # DualPipe's overlapped F&B pairs (ParallelConfig.overlap_forward_backward); false: one after the other
    overlap_forward_backward: bool = False


@dataclass
class ExpertsConfig:
    """MoE layers in every block. The router's keys are Megatron-Core's, without its ``moe_router_``
    prefix, with its meanings and defaults: ``score_function`` ("softmax", or DeepSeek-V3's
    "sigmoid"), ``enable_expert_bias`` (loss-free balancing: a per-expert bias that only chooses,
    moved after each step by ``bias_update_rate`` against the step's loads; sigmoid scores only, as
    Megatron requires). ``balance_coef`` is the course's `Router`'s: the Switch load-balancing
    loss's coefficient, per sequence (DeepSeek-V3's sequence-wise loss with sigmoid: 0.0001)."""
    num_experts: int = spec(min=1)          # required
    top_k: int = spec(2, min=1)
    capacity_factor: Optional[float] = spec(1.25, min=0.0, exclusive=True)   # null = no limit
    score_function: str = spec("softmax", choices=SCORE_FUNCTIONS)   # --moe-router-score-function
    enable_expert_bias: bool = False                                  # --moe-router-enable-expert-bias
    bias_update_rate: float = spec(1e-3, min=0.0, exclusive=True)    # --moe-router-bias-update-rate
    balance_coef: float = spec(0.01, min=0.0)
    z_coef: float = spec(0.001, min=0.0)    # the Router's router z-loss coefficient (ST-MoE); DeepSeek-V3: none

    def __post_init__(self):
        if self.enable_expert_bias and self.score_function != "sigmoid":
            raise ValueError(f"model.experts.enable_expert_bias=true needs model.experts.score_function="
                             f"'sigmoid' (got {self.score_function!r}): as in Megatron-Core, the bias "
                             f"balances DeepSeek-V3's sigmoid scores; with softmax probabilities of about "
                             f"1/{self.num_experts} each, bias_update_rate={self.bias_update_rate:g} a "
                             f"step would be another, much larger step")


@dataclass
class ModelConfig:
    """A preset (tiny, small, or debug: the golden run's `GPTConfig.tiny(n_layer=4)`), with any
    size given here replacing the preset's; no preset: `GPTConfig()`'s defaults."""
    preset: Optional[str] = spec(None, choices=("tiny", "small", "debug"))
    vocab_size: Optional[int] = spec(None, min=1)
    block_size: Optional[int] = spec(None, min=1)
    n_layer: Optional[int] = spec(None, min=1)
    n_head: Optional[int] = spec(None, min=1)
    n_embd: Optional[int] = spec(None, min=1)
    d_ff: Optional[int] = spec(None, min=1)
    dropout: Optional[float] = spec(None, min=0.0)
    bias: Optional[bool] = None
    tie_weights: Optional[bool] = None
    experts: Optional[ExpertsConfig] = None


@dataclass
class DataConfig:
    # documents: arithmetic documents of many lengths, padded to seq_len (reference.data.padded_documents)
    source: str = spec("stdlib", choices=("stdlib", "arithmetic", "synthetic", "documents"))
    seq_len: Optional[int] = spec(None, min=1)        # None: the model's block_size
    seed: int = spec(0, min=0)


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    every: int = spec(0, min=0)              # 0: only at the end (when dir is set)
    resume: bool = False                     # continue from the latest checkpoint, if there is one


@dataclass
class LogConfig:
    path: Optional[str] = None               # JSONL, one line per logged step
    every: int = spec(1, min=1)
    sample_tokens: int = spec(0, min=0)      # >0: a sample of that many bytes at each log


@dataclass
class TrainConfig:
    """One training run: every block of the JSON file (`load_config` fills it and checks it)."""
    train_batch_size: Optional[int] = spec(None, min=1)
    train_micro_batch_size_per_gpu: Optional[int] = spec(None, min=1)
    gradient_accumulation_steps: Optional[int] = spec(None, min=1)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: Optional[SchedulerConfig] = None
    gradient_clipping: float = spec(1.0, min=0.0)    # max global norm; 0 = off
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    steps: int = spec(100, min=1)
    seed: int = spec(0, min=0)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    steps_per_print: Optional[int] = None     # DeepSpeed's; no effect here (see log.every)
    wall_clock_breakdown: Optional[bool] = None
    zero_allow_untested_optimizer: Optional[bool] = None
    about: str = spec("", json=False)         # the file's "_about"
    path: Optional[str] = spec(None, json=False)

    def __post_init__(self):
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true: choose one precision "
                             "(DeepSpeed refuses the pair too)")
        given = [self.train_batch_size, self.train_micro_batch_size_per_gpu]
        if given == [None, None]:
            raise ValueError(f"give train_batch_size or train_micro_batch_size_per_gpu (with "
                             f"gradient_accumulation_steps={self.gradient_accumulation_steps}, "
                             f"any two determine the third)")

    @property
    def precision(self) -> str:
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def n_experts(self) -> Optional[int]:
        return self.model.experts.num_experts if self.model.experts else None

    def gpt_config(self) -> GPTConfig:
        from reference.parallel.golden import MODEL as DEBUG_MODEL

        m = self.model
        base = {"tiny": GPTConfig.tiny(), "small": GPTConfig.small(), "debug": DEBUG_MODEL,
                None: GPTConfig()}[m.preset]
        sizes = {k: getattr(m, k) for k in ("vocab_size", "block_size", "n_layer", "n_head",
                                            "n_embd", "d_ff", "dropout", "bias", "tie_weights")
                 if getattr(m, k) is not None}
        if "n_embd" in sizes and "d_ff" not in sizes:
            sizes["d_ff"] = None          # 4 x the new n_embd, not the preset's d_ff
        try:
            return replace(base, **sizes)
        except ValueError as e:
            raise ValueError(f"model ({self.path or 'configuration'}): {e}") from None

    def ffn_factory(self):
        """`GPT(cfg, ffn_factory=...)` for a model with experts, None for a dense one."""
        if self.model.experts is None:
            return None
        from reference.expert_parallel import moe_factory

        e = self.model.experts
        return moe_factory(e.num_experts, k=e.top_k, capacity_factor=e.capacity_factor,
                           score_function=e.score_function, balance_coef=e.balance_coef, z_coef=e.z_coef,
                           bias_update_rate=e.bias_update_rate if e.enable_expert_bias else 0.0)

    def seq_len(self) -> int:
        return self.data.seq_len or self.gpt_config().block_size

    def dp(self, world_size: int) -> int:
        """dp = world / (tp x pp); at least 1, so that a bad world size reads clearly."""
        return max(1, world_size // (self.parallelism.tensor * self.parallelism.pipeline))

    def batch_sizes(self, world_size: int) -> tuple[int, int, int]:
        """(train_batch_size, micro-batch per GPU, accumulation steps) at this world size."""
        dp = self.dp(world_size)
        B, mb, acc = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                      self.gradient_accumulation_steps)
        if mb is None:
            acc = acc or 1
            mb = B // (acc * dp) if B % (acc * dp) == 0 else None
        elif B is None:
            acc = acc or 1
            B = mb * acc * dp
        elif acc is None:
            acc = B // (mb * dp) if B % (mb * dp) == 0 else None
        if mb is None or acc is None or mb < 1 or acc < 1 or B != mb * acc * dp:
            raise ValueError(
                f"train_batch_size={self.train_batch_size} must equal train_micro_batch_size_per_gpu"
                f"={self.train_micro_batch_size_per_gpu} x gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps} x dp={dp} (world_size={world_size} / "
                f"(tensor={self.parallelism.tensor} x pipeline={self.parallelism.pipeline}))")
        return B, mb, acc

    def parallel_config(self, world_size: int) -> ParallelConfig:
        """The run's `ParallelConfig`, validated against the world, the model and the batch."""
        p = self.parallelism
        pc = ParallelConfig(dp=self.dp(world_size), tp=p.tensor, pp=p.pipeline, ep=p.expert,
                            zero_stage=self.zero_optimization.stage,
                            sequence_parallel=p.sequence_parallel, virtual_stages=p.virtual_stages,
                            schedule=p.schedule, precision=self.precision,
                            activation_checkpointing=self.activation_checkpointing.enabled,
                            embedding_stage=p.embedding_stage,
                            reshard_after_forward=p.reshard_after_forward, loss_mean=p.loss_mean,
                            optimizer_post_validation=p.optimizer_post_validation,
                            overlap_forward_backward=p.overlap_forward_backward,
                            zero3_engine=p.zero3_engine)
        where = f"{self.path or 'configuration'} at world_size={world_size}"
        try:
            try:
                B, _, acc = self.batch_sizes(world_size)
                batch_error = None
            except ValueError as e:
                acc, batch_error = self.gradient_accumulation_steps or 1, e
            pc = pc.with_(microbatches=acc)
            if pc.world_size != world_size:       # the degrees first: the batch depends on dp
                pc.validate(world_size)
            if batch_error is not None:
                raise batch_error
            pc.validate(world_size, self.gpt_config(), batch=(B, self.seq_len()),
                        n_experts=self.n_experts)
            wd = self.optimizer.params.weight_decay or 0.0
            if wd and pc.zero3_by_blocks:
                raise ValueError(f"optimizer.params.weight_decay={wd:g} with zero_optimization.stage 3 "
                                 f"at dp={pc.dp} (FSDP by blocks, zero3_engine={pc.zero3_engine!r}): its flat "
                                 f"shards hold one optimizer group, so biases and LayerNorms could not "
                                 f"be exempt from the decay as in every other layout; use stage 1 or "
                                 f"2, zero3_engine 'parameters', or weight_decay 0")
            if self.zero_optimization.offload:
                raise ValueError(OFFLOAD_REFUSED.format(
                    device=self.zero_optimization.offload_optimizer.device))
            return pc
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def _normalize(raw: dict) -> dict:
    """DeepSpeed's shorthands: `activation_checkpointing` as a bool, or a block without "enabled"."""
    ac = raw.get("activation_checkpointing")
    if isinstance(ac, bool):
        raw["activation_checkpointing"] = {"enabled": ac}
    elif isinstance(ac, dict) and "enabled" not in ac:
        raw["activation_checkpointing"] = {"enabled": True, **ac}
    return raw


def load_config(path: Union[str, Path], overrides: Optional[dict] = None, *,
                world_size: Optional[int] = None) -> TrainConfig:
    """Read a JSON file, apply ``overrides`` ({"optimizer.params.lr": "3e-4", ...}, strings parsed
    as JSON), check every key and type, and with ``world_size`` the batch and the degrees too."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no configuration file at {str(path)!r}"
                                + (" (it is a directory)" if path.is_dir() else ""))
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON at line {e.lineno}, column {e.colno}: "
                         f"{e.msg}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the configuration must be a JSON object, got "
                         f"{type(raw).__name__}")
    for key, value in (overrides or {}).items():
        set_dotted(raw, key, parse_value(value), where=str(path))
    about = raw.get("_about", "")
    config = build(TrainConfig, _normalize(raw), where=str(path))
    config = replace(config, about=about if isinstance(about, str) else "", path=str(path))
    if world_size is not None:
        config.parallel_config(world_size)
    return config

