"""The one factory that reads the ZeRO stage: each configuration gets its data-parallel way.
(Each way's numbers against one process are the parity tests': tests/test_parallel_parity.py,
tests/test_fsdp_composed.py, tests/test_fsdp_reshard.py, tests/test_zero.py.)"""
from __future__ import annotations

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
