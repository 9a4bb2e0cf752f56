"""Sampling from the 3D model gives the single-process model's tokens for the same seed."""
import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.parallel.config import ParallelConfig
from reference.runtime import launch

CFG = GPTConfig.tiny(n_layer=4, block_size=16)
PROMPT = torch.tensor([[1, 2, 3], [7, 8, 9]])  # T = 3: not a multiple of tp = 2
NEW = 15  # the context grows past block_size: the model then sees the last 16 tokens


def dense(temperature, top_k):
    torch.manual_seed(0)
    model = GPT(CFG)
    return model.generate(PROMPT, NEW, temperature, top_k, torch.Generator().manual_seed(5))


def _rank(configs, settings):
    from reference.parallel.generate import generate
    from reference.parallel.parallelize import parallelize

    out = []
    for config in configs:
        torch.manual_seed(0)
        pm = parallelize(GPT(CFG), config.mesh().build_groups(), config)
        for temperature, top_k in settings:
            out.append(generate(pm, PROMPT, NEW, temperature, top_k,
                                torch.Generator().manual_seed(5)).cpu())
    return out


SETTINGS = [(1.0, None), (0.8, 5), (0.0, None)]


@pytest.mark.parametrize("world_size, configs", [
    (2, [ParallelConfig(pp=2, microbatches=2), ParallelConfig(tp=2, sequence_parallel=True)]),
    (8, [ParallelConfig.debug_3d(), ParallelConfig.debug_3d().with_(zero_stage=3)]),
])
def test_parallel_sampling_equals_the_dense_model(world_size, configs):
    ranks = launch(_rank, world_size, configs, SETTINGS, timeout=300)
    want = [dense(t, k) for t, k in SETTINGS]
    for rank, outs in enumerate(ranks):
        for i, got in enumerate(outs):
            config, (t, k) = configs[i // len(SETTINGS)], SETTINGS[i % len(SETTINGS)]
            assert torch.equal(got, want[i % len(SETTINGS)]), \
                f"rank {rank}, {config}, temperature {t}, top_k {k}: {got} != {want[i % len(SETTINGS)]}"
