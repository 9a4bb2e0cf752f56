"""The one factory that reads the ZeRO stage: each configuration gets its data-parallel way.
(Each way's numbers against one process are the parity tests': tests/test_parallel_parity.py,
tests/test_fsdp_composed.py, tests/test_fsdp_reshard.py, tests/test_zero.py.)"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from reference.parallel import ParallelConfig
from reference.parallel.data_parallelism import (GradientShards, OptimizerShards, ParameterShards,
                                                 ParameterShardsPerBlock, Replicas, WholeModelShards,
                                                 data_parallelism)


def _mesh(dp_cp):
    return SimpleNamespace(dp_cp=dp_cp, group=lambda name: f"group {name}")


@pytest.mark.parametrize("zero_stage, dp_cp, way", [
    (0, 1, Replicas), (0, 2, Replicas), (1, 1, Replicas), (2, 1, Replicas),
    (1, 2, OptimizerShards), (2, 2, GradientShards)])
def test_replicas_and_zero_shards(zero_stage, dp_cp, way):
    got = data_parallelism(ParallelConfig(dp=dp_cp, zero_stage=zero_stage), _mesh(dp_cp))
    assert type(got) is way
    if way is not Replicas:
        assert got.group == "group dp_cp" and got.stage == zero_stage


def test_zero3_ways():
    """By blocks at tp = pp = ep = 1; per parameter otherwise, gathered once a step or per block."""
    assert type(data_parallelism(ParallelConfig(dp=2, zero_stage=3), _mesh(2))) is WholeModelShards
    config = ParallelConfig(dp=2, tp=2, zero_stage=3)
    assert type(data_parallelism(config, _mesh(2))) is ParameterShards
    per_block = data_parallelism(config.with_(reshard_after_forward=True), _mesh(2))
    assert type(per_block) is ParameterShardsPerBlock and per_block.reshard is None  # made at the first step
    assert per_block.sharded is None  # built by `build`, on the stages `parallelize` hands it


def test_zero3_by_blocks_refuses_weight_decay_and_names_the_way_out():
    way = WholeModelShards(dp_cp=4)
    with pytest.raises(ValueError, match=r"weight_decay=0.1 with zero_stage=3 \(dp\*cp=4\).*zero_stage 1 or 2"):
        way.make_optimizer([{"params": [], "weight_decay": 0.0}], object, 0.1)  # flat shards: 1-dim, no matrix


def test_the_zero3_engine_is_the_configurations_choice(tmp_path):
    """"auto" picks FSDP by blocks wherever it can run (tp = pp = ep = 1, no HSDP), whatever
    activation checkpointing says; "parameters" picks the rows anywhere; "blocks" where it
    cannot run is refused naming the degrees. The trainer's --check says which engine runs."""
    from reference.model import GPTConfig
    from reference.train.config import describe, load_config

    dp2 = ParallelConfig(dp=2, zero_stage=3)
    for config in (dp2, dp2.with_(activation_checkpointing=True), dp2.with_(zero3_engine="blocks")):
        assert config.zero3_engine_used == "blocks"
        assert type(data_parallelism(config, _mesh(2))) is WholeModelShards
    rows = dp2.with_(zero3_engine="parameters")
    assert rows.zero3_engine_used == "parameters" and type(data_parallelism(rows, _mesh(2))) is ParameterShards
    assert ParallelConfig(dp=2, tp=2, zero_stage=3).zero3_engine_used == "parameters"
    assert ParallelConfig(dp=2, zero_stage=1).zero3_engine_used is None
    blocks_pp = ParallelConfig(dp=2, pp=2, zero_stage=3, microbatches=2, zero3_engine="blocks")
    problems = blocks_pp.problems(4, GPTConfig.tiny(), None, None)
    assert len(problems) == 1 and "zero3_engine='blocks' with pp=2" in problems[0], problems
    assert "zero3_engine must be one of auto, blocks, parameters" in dp2.with_(zero3_engine="fsdp").problems(
        2, None, None, None)[0]
    for engine, said in (("auto", "FSDP by blocks"), ("parameters", "each parameter's rows")):
        path = tmp_path / f"{engine}.json"
        path.write_text(json.dumps({"train_batch_size": 8, "model": {"preset": "tiny"},
                                    "zero_optimization": {"stage": 3},
                                    "parallelism": {"zero3_engine": engine}}))
        config = load_config(path, world_size=2)
        assert config.parallel_config(2).zero3_engine == engine
        assert f"ZeRO-3 engine: {said} (zero3_engine='{engine}')" in describe(config, 2)
