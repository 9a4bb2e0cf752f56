"""Sampling from a tensor-parallel GPT draws the dense model's tokens, on every rank.

`GPT.generate` samples the next token from the logits the model returns. A TP model
returns, in eval mode, the whole logits gathered over the vocabulary (not this
rank's shard), so with the same seeded generator every rank draws the same token,
and the same as the dense model. Under sequence parallelism the context grows one
token at a time through lengths that tp does not divide; eval mode pads them.
"""
import copy

import torch
import torch.distributed as dist

from reference.mesh import Mesh
from reference.model import GPT, GPTConfig
from reference.runtime import launch
from reference.tensor_parallel import apply_tensor_parallel
from reference.tolerance import forward

TOL = forward()  # fp32: the same sums in another order (reference.tolerance)
# 251 is prime: padded to 252 on 2 ranks. 16 positions: a prompt of 3 and 15 new tokens
# pass through every length 3..16 (odd ones do not divide by tp = 2), and the context
# is cropped to block_size for the last two draws.
CFG = GPTConfig.tiny(vocab_size=251, block_size=16)
NEW = 15


def _gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _sampling_body():
    mesh = Mesh(tp=dist.get_world_size()).build_groups()
    dense = GPT.from_config_seed(CFG, 0)
    prompt = torch.randint(0, CFG.vocab_size, (2, 3), generator=torch.Generator().manual_seed(1))
    for sp in (False, True):
        what = f"sequence_parallel={sp}"
        model = apply_tensor_parallel(copy.deepcopy(dense), mesh, sequence_parallel=sp)
        for kwargs in (dict(temperature=1.0), dict(temperature=0.8, top_k=20), dict(temperature=0)):
            tokens = {}
            for name, m in (("dense", dense), ("tp", model)):
                g = torch.Generator().manual_seed(7)  # the same seed on every rank
                tokens[name] = m.generate(prompt, NEW, generator=g, **kwargs)
            assert model.training, "generate restores training mode"
            ranks = _gather(tokens["tp"])
            assert all(torch.equal(r, ranks[0]) for r in ranks), f"{what} {kwargs}: ranks drew {ranks}"
            assert torch.equal(tokens["tp"], tokens["dense"]), \
                f"{what} {kwargs}: TP drew {tokens['tp'].tolist()}, dense {tokens['dense'].tolist()}"
        # Eval mode, no targets: the whole (B, T, V) logits, here with T = 5 (odd).
        model.eval()
        with torch.no_grad():
            logits, _ = model(prompt.repeat(1, 2)[:, :5])
            expected, _ = dense.eval()(prompt.repeat(1, 2)[:, :5])
        torch.testing.assert_close(logits, expected, **TOL, msg=lambda m: f"{what} eval logits: {m}")
        model.train()
        dense.train()
    return "ok"


def test_generate_draws_the_dense_tokens_on_every_rank():
    assert launch(_sampling_body, 2, timeout=90.0, quiet=True, threads=1) == ["ok"] * 2
