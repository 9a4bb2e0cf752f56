"""`reference.zero.fully_shard` on a model the course did not write: one process and FSDP2 agree.

The small Transformer below has its own `Linear`, `Embedding` and `RMSNorm` (nothing from
`reference.model`). Every `Linear` and `Embedding` weight is sharded, a unit per block and the
root (embedding, final norm, head); the norms' gains stay replicated. In fp32, fp16 and bf16
``param_dtype`` with fp32 master weights and fp32 reduction, on 2 gloo ranks each starting from
its own random weights (rank 0's are broadcast at wrap time), the shards' gradients after one
backward and the whole weights after a few AdamW steps equal one process's, which computes the
whole batch with the weights cast to the same dtype and steps fp32 masters; and they equal
PyTorch's own `fully_shard` with the same `MixedPrecisionPolicy` on the same model.

One launch runs every variant; the tests only compare what it returned.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from reference import comms
from reference.runtime import launch
from reference.tolerance import adamw_weights, exact, gradient, loss as loss_tol
from reference.zero import MixedPrecisionPolicy, full_state_dict, fully_shard
from reference.zero.rows import shard_rows

WORLD, STEPS, LR, BATCH, SEED = 2, 3, 1e-3, 4, 0
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TIMEOUT = 240.0


# ---------------------------------------------------------------------------- the user's model
class Linear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))

    def forward(self, x):
        return x @ self.weight.t()


class Embedding(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.5)

    def forward(self, idx):
        return self.weight[idx]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * rms).type_as(x) * self.weight


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.qkv, self.proj = RMSNorm(dim), Linear(dim, 3 * dim), Linear(dim, dim)
        self.norm2, self.up, self.down = RMSNorm(dim), Linear(dim, 4 * dim), Linear(4 * dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=-1)                # (B, T, C) each
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)       # (B, H, T, C / H)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    """vocab 61 (odd: the embedding's and the head's rows are padded on 2 ranks), width 32."""

    def __init__(self, vocab=61, dim=32, heads=4, layers=2):
        super().__init__()
        self.embed = Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = RMSNorm(dim), Linear(dim, vocab)

    checkpoint = False  # activation checkpointing of every block

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x)
        logits = self.head(self.norm(x))                                   # (B, T, vocab)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_model(seed):
    torch.manual_seed(seed)
    return TinyTransformer()


def batch(step, rank, T=16, vocab=61):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, vocab, (BATCH, T + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def policy(name):
    dtype = DTYPES[name]
    return MixedPrecisionPolicy(param_dtype=None if dtype is torch.float32 else dtype,
                                reduce_dtype=torch.float32)


# ---------------------------------------------------------------------------- one process
def one_process(name):
    """The whole batch (every rank's) in one process: weights cast to the compute dtype for
    forward and backward, the gradient cast back, AdamW on fp32 masters. Returns (first
    gradients, weights after STEPS steps, losses)."""
    master = make_model(SEED)
    opt = torch.optim.AdamW(master.parameters(), lr=LR)
    grads, losses = None, []
    for step in range(STEPS):
        work = copy.deepcopy(master).to(DTYPES[name])
        xs, ys = zip(*(batch(step, r) for r in range(WORLD)))
        loss = work(torch.cat(xs), torch.cat(ys))
        loss.backward()
        losses.append(loss.item())
        for p, w in zip(master.parameters(), work.parameters()):
            p.grad = w.grad.float()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in master.named_parameters()}
        opt.step()
        opt.zero_grad()
    return grads, {k: p.detach().clone() for k, p in master.named_parameters()}, losses


# ---------------------------------------------------------------------------- on the ranks
def _ours(name):
    r = dist.get_rank()
    model = make_model(SEED + 1 + r)  # each rank its own weights: the wrap broadcasts rank 0's...
    if r == 0:
        model = make_model(SEED)      # ... which are the oracle's
    norms = {m.weight for m in model.modules() if isinstance(m, RMSNorm)}
    for block in model.blocks:
        fully_shard(block, mp_policy=policy(name), replicate_params=norms)
    fully_shard(model, mp_policy=policy(name), replicate_params=norms)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {"losses": []}
    for step in range(STEPS):
        loss = model(*batch(step, r))
        if step == 0:  # FSDP2's reshard_after_forward=None: the root stays whole, blocks are freed
            out["whole after forward"] = {
                "root": model.head.weight.untyped_storage().nbytes() > 0,
                "block": model.blocks[0].qkv.weight.untyped_storage().nbytes() > 0}
        loss.backward()
        out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
            out["shapes"] = {k: tuple(p.shape) for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["weights"] = full_state_dict(model)
    return out


def _torch(name):
    """PyTorch's fully_shard on the same model: a group per block and the root, every parameter
    sharded (the norms too: their mean gradient is the same either way)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy, fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor
    r = dist.get_rank()
    model = make_model(SEED)
    mp = TorchPolicy(param_dtype=policy(name).param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        torch_fully_shard(block, mp_policy=mp)
    torch_fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {"losses": []}
    for step in range(STEPS):
        loss = model(*batch(step, r))
        if step == 0:
            out["whole after forward"] = {"root": not isinstance(model.head.weight, DTensor),
                                          "block": not isinstance(model.blocks[0].qkv.weight, DTensor)}
        loss.backward()
        out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = {k: p.grad.full_tensor().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["weights"] = {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}
    return out


def _wrapped(mp):
    model = make_model(SEED)
    norms = {m.weight for m in model.modules() if isinstance(m, RMSNorm)}
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, replicate_params=norms)
    return fully_shard(model, mp_policy=mp, replicate_params=norms)


def _facts():
    """Bytes on the wire for one step, per reduce_dtype; gradient accumulation; an eval forward."""
    r, out = dist.get_rank(), {}
    for reduce in (None, torch.float32):
        model = _wrapped(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce))
        with comms.meter() as m:
            model(*batch(0, r)).backward()
        out["meter", reduce] = {op: (m.calls(op), m.payload_bytes(op))
                                for op in ("all_gather", "reduce_scatter", "all_reduce")}
    # N S per unit: each sharded tensor (d0, *rest) padded to N ceil(d0 / N) rows (p.zero_rows:
    # where it was cut); the norms' gains are not sharded
    units = [list(b.parameters()) for b in model.blocks] + [[model.embed.weight, model.head.weight]]
    out["unit numels"] = [sum(WORLD * math.ceil(w[0] / WORLD) * w[1:].numel()
                              for w in (p.zero_rows.whole for p in ps if hasattr(p, "zero_rows")))
                          for ps in units]
    model = _wrapped(MixedPrecisionPolicy())
    model(*batch(0, r)).backward()
    once = {k: p.grad.clone() for k, p in model.named_parameters()}
    model(*batch(0, r)).backward()  # a second backward adds into the shards' gradients
    out["accumulated"] = all(torch.equal(p.grad, 2 * once[k]) for k, p in model.named_parameters())
    with torch.no_grad():
        model(*batch(1, r))          # no backward follows: the step ends at the root's forward
    out["shards after eval"] = {k: tuple(p.shape) for k, p in model.named_parameters()}
    model.zero_grad()
    model.checkpoint = True          # each block's forward runs again inside the backward, whole
    with set_checkpoint_early_stop(False):  # (early stop would skip the block's forward hook)
        model(*batch(0, r)).backward()
    out["checkpointed"] = all(torch.equal(p.grad, once[k]) for k, p in model.named_parameters())
    return out


def _rank_body():
    out = {(impl, name): fn(name) for name in DTYPES for impl, fn in (("ours", _ours), ("torch", _torch))}
    out["facts"] = _facts()
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(_rank_body, WORLD, timeout=TIMEOUT, quiet=True)


@pytest.fixture(scope="module")
def oracle():
    return {name: one_process(name) for name in DTYPES}


# ---------------------------------------------------------------------------- the checks
@pytest.mark.parametrize("name", DTYPES)
def test_shard_gradients_equal_one_process(runs, oracle, name):
    want_grads = oracle[name][0]
    for rank, result in enumerate(runs):
        got = result["ours", name]
        for k, want in want_grads.items():
            rows = want if "norm" in k else shard_rows(want, rank, WORLD)  # norms: whole on every rank
            tol = gradient(WORLD, DTYPES[name]).at_scale(want.abs().max().item())
            tol.assert_close(got["grads"][k], rows, f"{name} rank {rank} {k}.grad")


@pytest.mark.parametrize("name", DTYPES)
def test_weights_after_steps_equal_one_process(runs, oracle, name):
    tol = adamw_weights(STEPS, LR, dtype=DTYPES[name])
    for rank, result in enumerate(runs):
        tol.assert_weights(result["ours", name]["weights"], oracle[name][1], f"{name} rank {rank}")


@pytest.mark.parametrize("name", DTYPES)
def test_equal_to_pytorch_fully_shard_bit_for_bit(runs, name):
    """The same arithmetic in the same order: each rank's forward and backward on the same
    ``param_dtype`` weights, the same casts, a mean over 2 ranks ((a + b) / 2 whichever comes
    first) and AdamW element by element; so `exact()`, losses, gradients and weights."""
    for rank, result in enumerate(runs):
        ours, theirs = result["ours", name], result["torch", name]
        assert ours["losses"] == theirs["losses"], (name, rank)
        exact().assert_weights(ours["weights"], theirs["weights"], f"{name} rank {rank} against fully_shard")
        for k, want in theirs["grads"].items():
            rows = want if "norm" in k else shard_rows(want, rank, WORLD)
            exact().assert_close(ours["grads"][k], rows, f"{name} rank {rank} {k}.grad against fully_shard")


@pytest.mark.parametrize("name", DTYPES)
def test_losses_equal_one_process(runs, oracle, name):
    """Each rank's loss is over its half of the batch: their mean is the one process's loss."""
    got = [sum(result["ours", name]["losses"][s] for result in runs) / WORLD for s in range(STEPS)]
    loss_tol(DTYPES[name]).assert_losses(got, oracle[name][2], f"{name} mean loss over ranks")


def test_root_stays_whole_after_forward_blocks_are_freed_as_fsdp2(runs):
    for result in runs:
        for name in DTYPES:
            assert result["ours", name]["whole after forward"] == {"root": True, "block": False}
            assert result["torch", name]["whole after forward"] == {"root": True, "block": False}


def test_bytes_per_step_follow_the_policy(runs):
    """bf16 compute: the all-gathers move 2 bytes a number; the reduce-scatters 2 with
    ``reduce_dtype=None`` (FSDP2: reduce in ``param_dtype``) and 4 with fp32. Blocks are gathered
    in forward and again in backward, the root once; the norms' gains all-reduced once per unit."""
    facts = runs[0]["facts"]
    blocks, root = facts["unit numels"][:-1], facts["unit numels"][-1]
    gathered = 2 * 2 * sum(blocks) + 2 * root
    for reduce, size in ((None, 2), (torch.float32, 4)):
        meter = facts["meter", reduce]
        assert meter["all_gather"] == (2 * len(blocks) + 1, gathered), reduce
        assert meter["reduce_scatter"] == (len(blocks) + 1, size * (sum(blocks) + root)), reduce
        assert meter["all_reduce"] == (len(blocks) + 1, size * (2 * 32 * len(blocks) + 32)), reduce


def test_gradients_accumulate_eval_ends_the_step_and_checkpointing_recomputes(runs):
    for rank, result in enumerate(runs):
        facts = result["facts"]
        assert facts["accumulated"]
        assert facts["checkpointed"]  # the same arithmetic, recomputed: bit for bit
        assert facts["shards after eval"] == result["ours", "fp32"]["shapes"]
        assert facts["shards after eval"]["embed.weight"] == (31, 32)  # ceil(61 / 2) rows
        assert facts["shards after eval"]["norm.weight"] == (32,)      # replicated: whole


def test_bad_arguments_are_refused_before_any_collective():
    with pytest.raises(TypeError, match="nn.Module"):
        fully_shard([Linear(2, 2)])
    with pytest.raises(ValueError, match="reshard_after_forward"):
        fully_shard(Linear(2, 2), reshard_after_forward=2)
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        fully_shard(Linear(2, 2), mp_policy={"param_dtype": torch.bfloat16})
