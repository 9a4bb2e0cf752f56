"""Parallel layers built directly are slices of the dense layer drawn from the same seed.

Megatron's master-weight init: every rank of the group draws the whole weight from a
generator seeded with the layer's `seed` (the same on every rank) and keeps its slice,
so a TP layer built with seed s is the dense `nn.Linear` built after
`torch.manual_seed(s)`, cut up, and an `ExpertParallelMoE` built with seed s holds the
experts of the `MoE` built after `torch.manual_seed(s)`. The ranks first draw a
rank-dependent amount from their own generators, so nothing here can rest on the
ranks' default random states being alike.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from reference.expert_parallel import ExpertParallelMoE, MoE
from reference.model import MLP, GPTConfig
from reference.runtime import launch
from reference.tensor_parallel import ColumnParallelLinear, RowParallelLinear, column_shard
from reference.tolerance import exact, forward

C, H, E = 8, 24, 4  # H divides by tp=2 x chunks=3; E experts, 2 per rank
SEED = 31


def _dense(in_features, out_features, seed):
    """The dense layer a TP layer with `seed` is a slice of; the caller's RNG is left alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(in_features, out_features)


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _build_layers():
    torch.rand(dist.get_rank() + 1)  # the ranks' default streams now stand apart
    group = dist.group.WORLD
    with pytest.raises(TypeError, match=r"ColumnParallelLinear: seed must be an int .* got 1\.5"):
        ColumnParallelLinear(C, H, group, seed=1.5)
    with pytest.raises(TypeError, match="RowParallelLinear: seed must be an int .* got None"):
        RowParallelLinear(H, C, group, seed=None)
    return {
        "column": _state(ColumnParallelLinear(C, H, group, seed=SEED)),
        "column_qkv": _state(ColumnParallelLinear(C, H, group, seed=SEED, chunks=3)),
        "row": _state(RowParallelLinear(H, C, group, seed=SEED)),
        "column_default": _state(ColumnParallelLinear(C, H, group)),
        "row_default": _state(RowParallelLinear(H, C, group)),
    }


@pytest.fixture(scope="module")
def layers():
    return launch(_build_layers, 2, quiet=True)


def test_column_parallel_shards_are_the_seeded_dense_weight(layers):
    dense = _dense(C, H, SEED)
    r0, r1 = layers[0]["column"], layers[1]["column"]
    assert not torch.equal(r0["weight"], r1["weight"]), "the two ranks hold the same shard"
    # Exact: the same generator and the same draws, only sliced.
    torch.testing.assert_close(torch.cat([r0["weight"], r1["weight"]]), dense.weight.detach(),
                               **exact())
    torch.testing.assert_close(torch.cat([r0["bias"], r1["bias"]]), dense.bias.detach(),
                               **exact())
    for rank in range(2):  # c_attn's [q | k | v] split: rank r holds [q_r | k_r | v_r]
        torch.testing.assert_close(layers[rank]["column_qkv"]["weight"],
                                   column_shard(dense.weight.detach(), rank, 2, chunks=3),
                                   **exact())


def test_row_parallel_shards_are_the_seeded_dense_weight(layers):
    dense = _dense(H, C, SEED)
    r0, r1 = layers[0]["row"], layers[1]["row"]
    assert not torch.equal(r0["weight"], r1["weight"]), "the two ranks hold the same shard"
    torch.testing.assert_close(torch.cat([r0["weight"], r1["weight"]], dim=1),
                               dense.weight.detach(), **exact())
    for r in (r0, r1):  # the bias is whole on every rank
        torch.testing.assert_close(r["bias"], dense.bias.detach(), **exact())


def test_the_default_seed_is_zero_on_every_rank(layers):
    column, row = _dense(C, H, 0), _dense(H, C, 0)
    torch.testing.assert_close(torch.cat([layers[r]["column_default"]["weight"] for r in range(2)]),
                               column.weight.detach(), **exact())
    torch.testing.assert_close(torch.cat([layers[r]["row_default"]["weight"] for r in range(2)],
                                         dim=1), row.weight.detach(), **exact())


def _tp_mlp_output(x):
    torch.rand(dist.get_rank() + 1)
    group = dist.group.WORLD
    c_fc = ColumnParallelLinear(C, H, group, seed=SEED)       # (B, T, C) -> (B, T, H // tp)
    c_proj = RowParallelLinear(H, C, group, seed=SEED + 1)    # (B, T, H // tp) -> (B, T, C), g
    return c_proj(nn.functional.gelu(c_fc(x)))


def test_a_directly_built_tp_mlp_is_the_dense_mlp():
    x = torch.randn(2, 5, C, generator=torch.Generator().manual_seed(3))
    mlp = MLP(GPTConfig.tiny(n_embd=C, n_head=2, d_ff=H))
    mlp.c_fc, mlp.c_proj = _dense(C, H, SEED), _dense(H, C, SEED + 1)
    expected = mlp(x).detach()
    for y in launch(_tp_mlp_output, 2, x, quiet=True):
        # fp32: the row layer sums two partial products (g) in another order than one GEMM.
        forward().assert_close(y.detach(), expected, "the TP MLP's output")


MOE_ARGS = dict(d_model=C, d_ff=H, n_experts=E, k=2, shared_expert=True)


def _build_moe():
    torch.rand(dist.get_rank() + 1)
    with pytest.raises(TypeError, match="ExpertParallelMoE: seed must be an int .* got '0'"):
        ExpertParallelMoE(**MOE_ARGS, group=dist.group.WORLD, seed="0")
    layer = ExpertParallelMoE(**MOE_ARGS, group=dist.group.WORLD, seed=SEED)
    return layer.expert_ids, _state(layer)


def test_expert_parallel_moe_holds_the_seeded_dense_experts():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        dense = MoE(**MOE_ARGS)
    results = launch(_build_moe, 2, quiet=True)
    assert [ids for ids, _ in results] == [[0, 1], [2, 3]]
    assert not torch.equal(results[0][1]["experts.0.c_fc.weight"],
                           results[1][1]["experts.0.c_fc.weight"]), "both ranks hold the same experts"
    for ids, state in results:
        for name, value in state.items():
            if name.startswith("experts."):  # local expert l is global expert ids[l]
                _, local, rest = name.split(".", 2)
                name = f"experts.{ids[int(local)]}.{rest}"
            # Exact: the same draws in the same order as the dense MoE's construction.
            torch.testing.assert_close(value, dense.state_dict()[name], **exact(),
                                       msg=lambda m, name=name: f"{name}: {m}")


def _embedding():
    from reference.tensor_parallel import VocabParallelEmbedding

    torch.rand(dist.get_rank() + 1)  # the ranks' default streams stand apart
    with pytest.raises(TypeError, match="VocabParallelEmbedding: seed must be an int"):
        VocabParallelEmbedding(11, C, dist.group.WORLD, seed="7")
    return VocabParallelEmbedding(11, C, dist.group.WORLD, seed=SEED).weight.detach().clone()


def test_vocab_parallel_embedding_rows_are_the_seeded_dense_table():
    """V = 11 over 2 ranks: padded to 12, rows 0-5 and 6-10 (+ one zero padding row)."""
    r0, r1 = launch(_embedding, 2, quiet=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        dense = nn.Embedding(11, C).weight.detach()
    assert torch.equal(torch.cat([r0, r1])[:11], dense)
    assert torch.equal(r1[-1], torch.zeros(C))  # the padding row
