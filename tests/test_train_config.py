"""reference.train.config: the trainer's JSON configuration in DeepSpeed's names.

Each file of configs/ loads and validates at its world size; `describe` explains the article's
DeepSpeed configuration on 8 ranks at tensor 2 x pipeline 4 and lists what is wrong with it;
overrides from a command line reach every key; every kind of bad input is a clear error; the
learning-rate schedules give DeepSpeed's formulas step by step. No process is started.
"""
import json
import math
from pathlib import Path

import pytest
import torch

from reference.parallel.config import ParallelConfig
from reference.train.config import TrainConfig, describe, load_config, make_scheduler, parse_value

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
ARTICLE = CONFIGS / "article_ds_config.json"
TP2_PP4 = {"parallelism.tensor": "2", "parallelism.pipeline": "4"}   # as --tensor 2 --pipeline 4


def write(tmp_path, raw, name="c.json") -> Path:
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return path


def minimal(**extra) -> dict:
    return {"train_batch_size": 8, "model": {"preset": "tiny"}, **extra}


# ---------------------------------------------------------------------------- configs/
def test_debug_3d_is_the_golden_debug_run():
    from reference.parallel import golden

    config = load_config(CONFIGS / "debug_3d.json", world_size=8)
    assert config.parallel_config(8) == ParallelConfig.debug_3d()
    assert config.gpt_config() == golden.MODEL
    assert config.batch_sizes(8) == (8, 2, 2) and config.seq_len() == 32
    assert (config.optimizer.torch_class(), config.optimizer.kwargs()) == (torch.optim.AdamW, {"lr": 3e-3, "weight_decay": 0.01})
    assert (config.data.source, config.steps, config.checkpoint.every) == ("arithmetic", 30, 10)
    assert config.log.path.endswith(".jsonl") and config.about
    assert describe(config, 8).endswith("inconsistent or pointless: nothing found")


def test_moe_4d_has_experts_on_top_of_3d():
    from reference.expert_parallel import MoE
    from reference.model import GPT

    config = load_config(CONFIGS / "moe_4d.json", world_size=8)
    assert config.parallel_config(8) == ParallelConfig.moe_4d()
    model = GPT(config.gpt_config(), ffn_factory=config.ffn_factory())
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(moes) == config.gpt_config().n_layer and {len(m.experts) for m in moes} == {4}
    assert describe(config, 8).endswith("nothing found")


def test_moe_deepseek_turns_on_deepseek_v3s_router_with_megatrons_keys():
    """The experts block's router keys mean what Megatron-Core's ``--moe-router-*`` mean, defaults
    included (softmax, no bias, rate 1e-3); the bias needs sigmoid scores, as there."""
    from reference.expert_parallel import MoE
    from reference.model import GPT

    config = load_config(CONFIGS / "moe_deepseek.json", world_size=4)
    model = GPT(config.gpt_config(), ffn_factory=config.ffn_factory())
    routers = [m.router for m in model.modules() if isinstance(m, MoE)]
    assert len(routers) == config.gpt_config().n_layer
    assert {(r.score_function, r.bias_update_rate, r.balance_coef) for r in routers} == {("sigmoid", 0.01, 1e-4)}
    assert {r.z_coef for r in routers} == {0.0}                  # DeepSeek-V3 has no router z-loss
    assert all(torch.equal(r.expert_bias, torch.zeros(4)) for r in routers)
    text = describe(config, 4)
    assert "sigmoid gate" in text and "loss-free balancing" in text and text.endswith("nothing found")
    plain = load_config(CONFIGS / "moe_4d.json", world_size=8)
    e = plain.model.experts
    assert (e.score_function, e.enable_expert_bias, e.bias_update_rate) == ("softmax", False, 1e-3)
    plain_model = GPT(plain.gpt_config(), ffn_factory=plain.ffn_factory())
    assert all(m.router.expert_bias is None for m in plain_model.modules() if isinstance(m, MoE))
    with pytest.raises(ValueError, match="enable_expert_bias=true needs model.experts.score_function='sigmoid'"):
        load_config(CONFIGS / "moe_4d.json", {"model.experts.enable_expert_bias": "true"}, world_size=8)


def test_debug_padded_trains_on_padded_documents_with_the_token_mean():
    from reference.train.loop import batch_at

    config = load_config(CONFIGS / "debug_padded.json", world_size=8)
    assert config.parallel_config(8) == ParallelConfig.debug_3d()   # loss_mean "tokens", the default
    assert config.data.source == "documents" and config.parallelism.loss_mean == "tokens"
    _, targets = batch_at("documents", 8, config.seq_len(), 0, config.data.seed)
    counted = (targets != -100).sum(1)
    assert len(set(counted.tolist())) > 1 and int(counted.min()) >= 1  # every row its own count
    assert describe(config, 8).endswith("nothing found")
    with pytest.raises(ValueError, match="loss_mean"):
        load_config(CONFIGS / "debug_padded.json", {"parallelism.loss_mean": "sum"})
    old = load_config(CONFIGS / "debug_padded.json", {"parallelism.loss_mean": "mean_of_means"})
    assert "average of their means is not one process's loss" in describe(old, 8)


def test_article_config_is_the_articles_file_and_check_explains_every_key():
    """The article's file exactly (lr 6e-5, no scheduler, fp16 {"enabled": true}, ZeRO-3 with
    the optimizer offloaded, an activation_checkpointing block). On 8 ranks with no
    parallelism block dp is 8; the trainer refuses it, for reasons `describe` lists: nothing
    is offloaded here (ZeRO-3 with recompute trains: per-parameter shards)."""
    raw = json.loads(ARTICLE.read_text())
    assert raw["optimizer"] == {"type": "AdamW", "params": {"lr": 6e-5}}
    assert "scheduler" not in raw and raw["fp16"] == {"enabled": True}
    assert raw["activation_checkpointing"] == {"partition_activations": True,
                                               "contiguous_memory_optimization": True}
    config = load_config(ARTICLE)
    assert config.batch_sizes(8) == (4096, 64, 8)        # 4096 = 64 x 8 x dp 8
    assert config.optimizer.kwargs() == {"lr": 6e-5, "weight_decay": 0.0}   # DeepSpeed's default
    assert config.fp16.scaler_kwargs() == dict(initial_scale_power=16, window=1000, hysteresis=2,
                                               min_scale=1.0, static=None,
                                               consecutive_hysteresis=False)
    with pytest.raises(ValueError, match="offload_optimizer .device 'cpu'. is not implemented"):
        config.parallel_config(8)
    no_offload = load_config(ARTICLE, {"zero_optimization.offload_optimizer.device": "none"})
    no_offload.parallel_config(8)  # ZeRO-3 with recompute: FSDP by blocks ("auto"), as without it
    text = describe(config, 8)
    explained = {  # every key of the file, and where --check says what it does
        "train_batch_size": "train_batch_size 4096 = micro-batch 64 x accumulation 8 x dp 8",
        "gradient_accumulation_steps": "accumulation 8",
        "optimizer": "AdamW (torch.optim.AdamW: lr 6e-05, weight_decay 0)",
        "weight_decay (unset)": "DeepSpeed's default 0",
        "gradient_clipping": "clip the global norm at 1",
        "fp16": "fp16 with dynamic loss scaling from 2^16",
        "zero_optimization.stage": "stage 3 at dp 8",
        "zero_optimization.offload_optimizer": "offload_optimizer (device 'cpu') is not implemented",
        "activation_checkpointing": "the activation_checkpointing block turns it on",
        "activation_checkpointing.partition_activations": "partition_activations: no effect here",
        "activation_checkpointing.contiguous_memory_optimization":
            "contiguous_memory_optimization=True: DeepSpeed's, no effect here",
        "scheduler (none)": "constant lr",
    }
    for key, words in explained.items():
        assert words in text, key
    assert "zero_stage=3 with activation_checkpointing" not in text


def test_describe_article_at_tensor_2_pipeline_4():
    config = load_config(ARTICLE, TP2_PP4)
    text = describe(config, 8)                          # reports, does not raise
    assert "world 8 = dp 1 x tp 2 x pp 4" in text
    problems = text.split("inconsistent or pointless:")[1]
    assert "dp is 1, so ZeRO-3 shards nothing" in problems
    assert "a batch of 4096 in 8 accumulation steps at dp 1 is a micro-batch of 512 sequences per GPU" in problems
    assert "DeepSpeed's pipeline engine refuses ZeRO-2 and 3" in problems
    assert "2^16 = 65536" in text and "524,288 tokens per step" in text   # 4096 x 128
    with pytest.raises(ValueError, match=r"(?s)world_size=8.*offload_optimizer"):
        config.parallel_config(8)


def test_describe_never_raises_on_a_broken_configuration(tmp_path):
    raw = minimal(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2,
                  parallelism={"tensor": 3, "sequence_parallel": True},
                  zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True},
                  activation_checkpointing={"partition_activations": True})
    text = describe(load_config(write(tmp_path, raw)), 8)
    for part in ("train_batch_size=8 must equal train_micro_batch_size_per_gpu=3 x "
                 "gradient_accumulation_steps=2 x dp=2", "dp=2 x tp=3 x pp=1 = 6, but world_size=8",
                 "offload_optimizer needs ZeRO stage 1, 2 or 3", "overlap_comm=True: DeepSpeed's, no effect",
                 "partition_activations: no effect here"):
        assert part in text, part


# ---------------------------------------------------------------------------- overrides
def test_overrides_reach_every_key_and_parse_strings():
    config = load_config(CONFIGS / "debug_3d.json", {
        "optimizer.params.lr": "3e-4", "optimizer.params.betas": "[0.9, 0.95]", "steps": "10",
        "parallelism.tensor": 1, "parallelism.sequence_parallel": "false", "log.path": "x.jsonl",
        "scheduler.type": "WarmupCosineLR", "scheduler.params.warmup_num_steps": "2"})
    assert config.optimizer.kwargs() == {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.01}
    assert (config.steps, config.parallelism.tensor, config.parallelism.sequence_parallel) == (10, 1, False)
    assert config.log.path == "x.jsonl" and config.scheduler.params.warmup_num_steps == 2
    assert config.parallel_config(4).dp == 2            # dp = world / (tp x pp) = 4 / (1 x 2)


def test_parse_value():
    cases = {"3e-4": 3e-4, "10": 10, "true": True, "False": False, "null": None, "cpu": "cpu",
             "[0.9, 0.95]": [0.9, 0.95], "{\"device\": \"cpu\"}": {"device": "cpu"}, 7: 7}
    for text, value in cases.items():
        assert parse_value(text) == value and type(parse_value(text)) is type(value), text


def test_override_into_a_value_that_is_not_a_block():
    with pytest.raises(ValueError, match=r"cannot override 'steps.max': steps is 30, not a block"):
        load_config(CONFIGS / "debug_3d.json", {"steps.max": 1})


# ---------------------------------------------------------------------------- errors
def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no configuration file at '.*nowhere\.json'"):
        load_config(tmp_path / "nowhere.json")


def test_malformed_json_gives_line_and_column(tmp_path):
    path = write(tmp_path, '{\n  "train_batch_size": 8,\n  "steps": 3,,\n}')
    # line 3 is '  "steps": 3,,': its second comma, column 14, is where a key should start
    with pytest.raises(ValueError, match=r"malformed JSON at line 3, column 14: Expecting property name"):
        load_config(path)


@pytest.mark.parametrize("raw, message", [
    (minimal(train_batch_sise=8), r"unknown key 'train_batch_sise'; did you mean 'train_batch_size'\?"),
    (minimal(optimizer={"params": {"lrr": 1e-3}}), r"unknown key 'optimizer.params.lrr'; did you mean 'optimizer.params.lr'\?"),
    (minimal(tensor=2), r"unknown key 'tensor'; did you mean 'parallelism.tensor'\?"),
    (minimal(zero_optimization={"stage": 1, "offload_optimiser": {}}),
     r"unknown key 'zero_optimization.offload_optimiser'; did you mean 'zero_optimization.offload_optimizer'\?"),
    (minimal(data={"colour": "red"}), r"unknown key 'data.colour'; the keys here are source, seq_len, seed"),
])
def test_unknown_key_names_its_path_and_the_nearest_key(tmp_path, raw, message):
    with pytest.raises(ValueError, match=message):
        load_config(write(tmp_path, raw))


def test_keys_starting_with_underscore_are_comments(tmp_path):
    raw = minimal(_about="a run", optimizer={"_why": "defaults", "params": {"_note": 1, "lr": 0.1}})
    config = load_config(write(tmp_path, raw))
    assert config.about == "a run" and config.optimizer.params.lr == 0.1


@pytest.mark.parametrize("raw, message", [
    (minimal(steps="ten"), r"steps must be an integer, got 'ten' \(str\)"),
    (minimal(parallelism={"tensor": True}), r"parallelism.tensor must be an integer, got True"),
    (minimal(parallelism={"sequence_parallel": 1}), r"parallelism.sequence_parallel must be true or false, got 1"),
    (minimal(optimizer={"params": {"betas": [0.9]}}), r"optimizer.params.betas must be a list of 2 numbers"),
    (minimal(fp16=True), r"fp16 must be a JSON object, got True"),
    (minimal(steps=0), r"steps=0 must be >= 1"),
    (minimal(optimizer={"type": "Adamw"}), r"optimizer.type='Adamw' must be one of 'AdamW', 'Adam', 'SGD'; did you mean 'AdamW'\?"),
    (minimal(scheduler={"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}),
     r"scheduler.params.cos_min_ratio=0.1 is not a parameter of WarmupLR"),
    (minimal(optimizer={"type": "AdamW", "params": {"momentum": 0.9}}), r"optimizer.params.momentum=0.9 is not a parameter of 'AdamW'"),
    (minimal(model={"experts": {"top_k": 1}}), r"model.experts needs model.experts.num_experts"),
])
def test_wrong_values_name_key_value_and_expectation(tmp_path, raw, message):
    with pytest.raises(ValueError, match=message):
        load_config(write(tmp_path, raw))


def test_fp16_and_bf16_both_enabled(tmp_path):
    raw = minimal(fp16={"enabled": True}, bf16={"enabled": True})
    with pytest.raises(ValueError, match=r"fp16.enabled and bf16.enabled are both true"):
        load_config(write(tmp_path, raw))


def test_batch_sizes_follow_deepspeeds_rule(tmp_path):
    """train_batch_size = micro x accumulation x dp: any two give the third; three must agree."""
    def sizes(**batch):
        raw = {"parallelism": {"tensor": 2, "pipeline": 2}, "model": {"preset": "debug"}, **batch}
        return load_config(write(tmp_path, raw)).batch_sizes(8)          # dp = 8 / (2 x 2) = 2

    assert sizes(train_batch_size=16, gradient_accumulation_steps=2) == (16, 4, 2)
    assert sizes(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2) == (16, 4, 2)
    assert sizes(train_batch_size=16, train_micro_batch_size_per_gpu=4) == (16, 4, 2)
    assert sizes(train_batch_size=16) == (16, 8, 1)
    with pytest.raises(ValueError, match=r"train_batch_size=16 must equal train_micro_batch_size_per_gpu"
                                         r"=3 x gradient_accumulation_steps=2 x dp=2 \(world_size=8"):
        sizes(train_batch_size=16, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=None x gradient_accumulation_steps=3 x dp=2"):
        sizes(train_batch_size=16, gradient_accumulation_steps=3)        # 16 / (3 x 2) is no integer
    with pytest.raises(ValueError, match=r"give train_batch_size or train_micro_batch_size_per_gpu"):
        sizes(gradient_accumulation_steps=2)


def test_degrees_that_do_not_fit_the_world(tmp_path):
    path = write(tmp_path, minimal(parallelism={"tensor": 3}))
    with pytest.raises(ValueError, match=r"(?s)at world_size=8: invalid parallel configuration .*"
                                         r"dp=2 x tp=3 x pp=1 = 6, but world_size=8"):
        load_config(path, world_size=8)
    with pytest.raises(ValueError, match=r"n_head=4 is not a multiple of tp=3"):   # the model checked too
        load_config(path).parallel_config(6)


def test_model_sizes_replace_the_preset(tmp_path):
    config = load_config(write(tmp_path, minimal(model={"preset": "tiny", "n_embd": 64})))
    assert (config.gpt_config().n_embd, config.gpt_config().d_ff) == (64, 256)  # 4 x 64, not tiny's 128
    with pytest.raises(ValueError, match=r"model .*n_embd=30 must be divisible by n_head=4"):
        load_config(write(tmp_path, minimal(model={"preset": "tiny", "n_embd": 30}))).gpt_config()


def test_activation_checkpointing_switch(tmp_path):
    def on(value):
        raw = minimal() if value is None else minimal(activation_checkpointing=value)
        config = load_config(write(tmp_path, raw))
        assert config.parallel_config(1).activation_checkpointing == config.activation_checkpointing.enabled
        return config.activation_checkpointing.enabled

    assert on(None) is False                                    # no block: off
    assert on({"partition_activations": False}) is True         # DeepSpeed's block: on
    assert on({"enabled": False, "partition_activations": True}) is False
    assert (on(True), on(False)) == (True, False)


def test_optimizer_types_follow_deepspeed(tmp_path):
    def made(optimizer):
        config = load_config(write(tmp_path, minimal(optimizer=optimizer)))
        return config.optimizer.torch_class(), config.optimizer.kwargs()

    # DeepSpeed's "Adam" applies decoupled weight decay unless adam_w_mode is false
    assert made({"type": "Adam", "params": {"weight_decay": 0.1}}) == (torch.optim.AdamW, {"weight_decay": 0.1})
    assert made({"type": "Adam", "params": {"adam_w_mode": False}})[0] is torch.optim.Adam
    assert made({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}) == (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0})


# ---------------------------------------------------------------------------- lr schedules
def lrs(tmp_path, scheduler, lr=1e-3, steps=8, n=8):
    """The lr each of n optimizer steps runs at."""
    config = load_config(write(tmp_path, minimal(scheduler=scheduler, steps=steps)))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make_scheduler(optimizer, config)
    out = []
    for _ in range(n):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        sched.step()
    return out


# DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py) evaluated by hand; LambdaLR computes
# base_lr x (lr / base_lr) in float64, so they agree to rounding: rel 1e-12.
CLOSE = dict(rel=1e-12, abs=1e-15)


def test_warmup_lr_linear_and_log(tmp_path):
    linear = {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear"}
    assert lrs(tmp_path, {"type": "WarmupLR", "params": linear}, n=6) == pytest.approx(
        [0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3], **CLOSE)
    log = {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 4}   # "log" by default
    want = [1e-4 + 9e-4 * math.log(s + 1) / math.log(4) for s in range(4)] + [1e-3]
    assert lrs(tmp_path, {"type": "WarmupLR", "params": log}, lr=5.0, n=5) == pytest.approx(want, **CLOSE)


def test_warmup_decay_lr(tmp_path):
    params = {"warmup_max_lr": 1e-3, "warmup_num_steps": 2, "warmup_type": "linear", "total_num_steps": 6}
    assert lrs(tmp_path, {"type": "WarmupDecayLR", "params": params}) == pytest.approx(
        [0, 5e-4, 1e-3, 7.5e-4, 5e-4, 2.5e-4, 0, 0], **CLOSE)   # (6 - s) / (6 - 2) after warm-up
    no_total = {k: v for k, v in params.items() if k != "total_num_steps"}
    assert lrs(tmp_path, {"type": "WarmupDecayLR", "params": no_total}, steps=6) == pytest.approx(
        [0, 5e-4, 1e-3, 7.5e-4, 5e-4, 2.5e-4, 0, 0], **CLOSE)   # total_num_steps: the run's steps


def test_warmup_cosine_lr(tmp_path):
    params = {"warmup_min_ratio": 0.1, "warmup_num_steps": 2, "warmup_type": "linear",
              "cos_min_ratio": 0.0, "total_num_steps": 6}
    ratios = [0.1, 0.55] + [(1 + math.cos(math.pi * min(1.0, (s - 1) / 4))) / 2 for s in range(2, 8)]
    assert lrs(tmp_path, {"type": "WarmupCosineLR", "params": params}, lr=1e-2) == pytest.approx(
        [1e-2 * r for r in ratios], **CLOSE)
    assert ratios[3] == pytest.approx(0.5) and ratios[-1] == 0.0


def test_no_scheduler_keeps_the_lr(tmp_path):
    assert lrs(tmp_path, None, lr=0.25, n=3) == [0.25, 0.25, 0.25]


def test_optimizer_post_validation_is_a_parallelism_key():
    """``parallelism.optimizer_post_validation`` reaches `ParallelConfig` (off by default), and
    ``--check`` says what it does; with ZeRO it is refused."""
    plain = load_config(CONFIGS / "debug_3d.json", world_size=8)
    assert plain.parallel_config(8).optimizer_post_validation is False
    assert "optimizer_post_validation" not in describe(plain, 8)
    config = load_config(CONFIGS / "debug_3d.json", {"parallelism.optimizer_post_validation": True},
                         world_size=8)
    assert config.parallel_config(8).optimizer_post_validation is True
    text = describe(config, 8)
    assert "optimizer_post_validation: each rank steps at once" in text and text.endswith("nothing found")
    with pytest.raises(ValueError, match="optimizer_post_validation undoes a step"):
        load_config(CONFIGS / "debug_3d.json", {"parallelism.optimizer_post_validation": True,
                                               "zero_optimization.stage": 1}, world_size=8)


def test_overlap_forward_backward_is_a_parallelism_key():
    """``parallelism.overlap_forward_backward`` reaches `ParallelConfig` (off by default); ``--check``
    says on or off for every DualPipeV and DualPipe run; with another schedule it is refused."""
    dualpipev = {"parallelism.schedule": "dualpipev", "parallelism.virtual_stages": 2,
                 "parallelism.tensor": 1, "train_batch_size": 16, "gradient_accumulation_steps": 4}
    plain = load_config(CONFIGS / "moe_4d.json", dualpipev, world_size=4)
    assert plain.parallel_config(4).overlap_forward_backward is False
    assert "overlap_forward_backward: off" in describe(plain, 4)
    config = load_config(CONFIGS / "moe_4d.json", {**dualpipev, "parallelism.overlap_forward_backward": True},
                         world_size=4)
    assert config.parallel_config(4).overlap_forward_backward is True
    text = describe(config, 4)
    assert "overlap_forward_backward: each F&B pair's forward and backward in turns" in text
    assert text.endswith("nothing found")
    with pytest.raises(ValueError, match="overlap_forward_backward overlaps DualPipeV.s F&B pairs"):
        load_config(CONFIGS / "moe_4d.json", {"parallelism.overlap_forward_backward": True}, world_size=8)
    # DualPipe in two directions pairs F and B as DualPipeV does: the switch is accepted, and said
    dualpipe = {**dualpipev, "parallelism.schedule": "dualpipe", "parallelism.overlap_forward_backward": True}
    text = describe(load_config(CONFIGS / "moe_4d.json", dualpipe, world_size=4), 4)
    assert "overlap_forward_backward: each F&B pair's forward and backward in turns" in text
    assert text.endswith("nothing found")
