"""ParallelConfig: presets, derived sizes, and validate's errors (pure, no processes)."""
import pytest

from reference.model import GPTConfig
from reference.parallel.config import ParallelConfig

TINY = GPTConfig.tiny(n_layer=4)  # 4 heads, d_ff 128, vocab 256


def test_presets_are_consistent():
    assert ParallelConfig.single().world_size == 1
    c = ParallelConfig.debug_3d()
    assert (c.dp, c.tp, c.pp, c.world_size) == (2, 2, 2, 8)
    c.validate(8, TINY, batch=(8, 32))
    ParallelConfig.moe_4d().validate(8, TINY, batch=(8, 32), n_experts=4)
    big = ParallelConfig.article_175b()
    assert big.world_size == 1024
    gpt3 = GPTConfig(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, n_embd=12288)
    big.validate(1024, gpt3, batch=(1536, 2048))  # GPT-3's batch of 1536 sequences
    assert c.mesh().world_size == 8 and c.with_(dp=1).world_size == 4
    # ZeRO-3 per parameter composes with TP (and SP), a pipeline and checkpointing
    c.with_(zero_stage=3, activation_checkpointing=True).validate(8, TINY, batch=(8, 32))


def _problems(config, world_size, cfg=TINY, batch=None, n_experts=None) -> str:
    with pytest.raises(ValueError) as err:
        config.validate(world_size, cfg, batch=batch, n_experts=n_experts)
    return str(err.value)


@pytest.mark.parametrize("config, world, kwargs, expected", [
    (ParallelConfig(dp=2, tp=2, pp=2), 4, {}, "dp=2 x tp=2 x pp=2 = 8, but world_size=4"),
    (ParallelConfig(tp=3), 3, {}, "n_head=4 is not a multiple of tp=3"),
    (ParallelConfig(tp=3), 3, {}, "d_ff=128 is not a multiple of tp=3"),
    (ParallelConfig(pp=4, virtual_stages=2, schedule="interleaved", microbatches=4), 4, {},
     "n_layer=4 < pp=4 x virtual_stages=2"),
    (ParallelConfig(pp=4, microbatches=2), 4, {}, "microbatches=2 < pp=4"),
    (ParallelConfig(dp=4, ep=3), 4, {"n_experts": 6}, "ep=3 must divide dp=4"),
    (ParallelConfig(dp=4, ep=4), 4, {"n_experts": 6}, "n_experts=6 is not a multiple of ep=4"),
    (ParallelConfig(dp=2, ep=2), 2, {}, "needs a model with experts"),
    (ParallelConfig(dp=2, microbatches=3), 2, {"batch": 8},
     "global batch 8 does not divide into dp=2 x microbatches=3 = 6"),
    (ParallelConfig(dp=2, pp=2, zero_stage=2, microbatches=2), 4, {},
     "zero_stage=2 with pp=2: a pipeline would reduce-scatter the gradients once per micro-batch"),
    (ParallelConfig(tp=2, sequence_parallel=True), 2, {"batch": (4, 31)},
     "T=31 is not a multiple of tp=2"),
    (ParallelConfig(virtual_stages=2, pp=2, microbatches=2), 2, {},
     "virtual_stages=2 needs schedule='interleaved'"),
    (ParallelConfig(schedule="zigzag"), 1, {}, "schedule must be one of gpipe, 1f1b, interleaved"),
    (ParallelConfig(precision="fp8"), 1, {}, "precision must be one of fp32, bf16, fp16"),
    (ParallelConfig(pp=2, embedding_stage=True, microbatches=2), 2, {},
     "embedding_stage needs at least 3 stages"),
    (ParallelConfig(dp=0), 0, {}, "degrees and counts must be positive ints: dp=0"),
])
def test_validate_names_every_value(config, world, kwargs, expected):
    assert expected in _problems(config, world, **kwargs)


def test_validate_lists_all_problems_at_once():
    text = _problems(ParallelConfig(dp=2, tp=3, pp=2, microbatches=1), 8, batch=7)
    for part in ("= 12, but world_size=8", "n_head=4", "microbatches=1 < pp=2", "global batch 7"):
        assert part in text


@pytest.mark.parametrize("config, world", [
    (ParallelConfig(precision="fp8"), 1),
    (ParallelConfig(pp=2, microbatches=2, precision="fp8"), 2),
    (ParallelConfig(dp=2, pp=2, zero_stage=2, microbatches=1, precision="int8", schedule="zigzag"), 4),
    (ParallelConfig(tp=3, virtual_stages=2, precision="fp8"), 3),
])
def test_validate_lists_each_problem_once(config, world):
    problems = config.problems(world, TINY, None, None)
    assert problems and len(problems) == len(set(problems)), problems


def test_str_names_what_is_on():
    assert str(ParallelConfig.debug_3d()) == "dp=2 tp=2 pp=2 sp 1f1b m=2"
    assert str(ParallelConfig.single()) == "dp=1 tp=1 pp=1"
