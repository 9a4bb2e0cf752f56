"""The single-process training run that parallel versions are compared with."""

import math
import subprocess
import sys

import pytest
import torch

from reference.data import ByteCorpus, synthetic_batch
from reference.model import GPT, GPTConfig
from reference.train import evaluate, make_optimizer, train, train_step

STEPS, BATCH, LR = 40, 16, 3e-3


@pytest.fixture(scope="module")
def data():
    return ByteCorpus.load(200_000)


@pytest.fixture(scope="module")
def run(data):
    model = GPT.from_config_seed(GPTConfig.tiny(), 0)
    return train(model, STEPS, BATCH, lr=LR, data=data, seed=0, progress=False)


def test_initial_loss_is_near_uniform(run):
    model = GPT.from_config_seed(GPTConfig.tiny(), 0)
    # On uniformly random tokens, logits of a fresh model are near zero
    # (weights ~ N(0, 0.02)), so the loss is about ln 256 = 5.545. Over seeds
    # 0..9 it stays within 0.01 of it; 0.05 leaves room.
    x, y = synthetic_batch(BATCH, 32, seed=0)
    _, loss = model(x, y)
    assert abs(loss.item() - math.log(256)) < 0.05
    # The first training loss, on Python source, starts a little lower (5.44
    # to 5.49 over seeds 0..9): with tied weights the current byte's own
    # logit is raised, and source code often repeats a byte (runs of
    # spaces). 0.2 covers that.
    assert abs(run[0] - math.log(256)) < 0.2


def test_loss_falls_on_the_corpus(run):
    assert len(run) == STEPS and all(math.isfinite(l) for l in run)
    # Measured: 5.45 at the first step, about 3.0 averaged over steps 35..39,
    # a drop of about 2.4. Batch-to-batch noise is about 0.2, so asking for
    # 1.5 is both clearly learning and far from flaky.
    first, last5 = run[0], sum(run[-5:]) / 5
    assert last5 < first - 1.5, (first, last5)


def test_training_is_deterministic(run, data):
    model = GPT.from_config_seed(GPTConfig.tiny(), 0)
    again = train(model, 10, BATCH, lr=LR, data=data, seed=0, progress=False)
    assert again == run[:10]  # bit for bit: same weights, batches, order of operations
    other = GPT.from_config_seed(GPTConfig.tiny(), 0)
    different = train(other, 3, BATCH, lr=LR, data=data, seed=1, progress=False)
    assert different[0] != run[0]  # another seed draws other batches


def test_train_leaves_global_rng_alone(data):
    model = GPT.from_config_seed(GPTConfig.tiny(dropout=0.1), 0)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    train(model, 2, 4, data=data, progress=False)
    assert torch.equal(torch.get_rng_state(), state)


def test_train_step_matches_a_hand_written_step():
    a = GPT.from_config_seed(GPTConfig.tiny(), 0)
    b = GPT.from_config_seed(GPTConfig.tiny(), 0)
    x, y = synthetic_batch(4, 32, seed=0)
    opt_a = make_optimizer(a, 1e-3)
    loss_a = train_step(a, opt_a, x, y)

    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    _, loss_b = b(x, y)
    loss_b.backward()
    opt_b.step()
    assert loss_a == loss_b.item()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=name)
        assert pa.grad is None  # gradients freed after the step


def test_weight_decay_skips_biases_and_norms():
    model = GPT.from_config_seed(GPTConfig.tiny(), 0)
    assert len(make_optimizer(model, 1e-3).param_groups) == 1
    decay, no_decay = make_optimizer(model, 1e-3, weight_decay=0.1).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_eval_callback_and_evaluate(data):
    model = GPT.from_config_seed(GPTConfig.tiny(), 0)
    seen = []
    train(model, 5, 4, data=data, progress=False, eval_every=2, on_eval=lambda s, v: seen.append((s, v)))
    assert [s for s, _ in seen] == [1, 3, 4]  # every 2 steps and after the last
    assert seen[-1][1] == evaluate(model, data.val, 4)  # fixed batches: same value again
    with pytest.raises(ValueError, match="ByteCorpus"):
        train(model, 1, 4, data=data.train, eval_every=1, progress=False)


def test_oracle_imports_no_distributed_course_module():
    # A fresh interpreter: the oracle modules must load without any of the
    # course's torch.distributed code (runtime, mesh, comms, ...).
    code = (
        "import sys, reference.model, reference.data, reference.train\n"
        "print(sorted(m for m in sys.modules if m.startswith('reference')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(eval(out.stdout))
    assert loaded == {"reference", "reference.model", "reference.data", "reference.train",
                      "reference.train.single", "reference.loss"}, loaded


def test_oracle_loss_fn_backpropagates_each_chunks_own_mean():
    """accumulate_gradients with ``loss_fn``: each chunk backpropagates (loss + aux) / chunks.
    Given the GPT's own LM mean and aux loss, that is ``loss_mean="mean_of_means"`` bit for
    bit; padding in one chunk only makes it differ from the default token mean."""
    from reference.expert_parallel import moe_factory
    from reference.loss import IGNORE_INDEX
    from reference.model import lm_loss
    from reference.train.single import accumulate_gradients

    x, y = synthetic_batch(4, 16, seed=0)
    y[0, :12] = IGNORE_INDEX  # the first of 2 chunks counts 20 tokens, the second 32

    def gpt_loss(model, x, y):
        logits, aux = model.logits_and_aux(x)
        return lm_loss(logits, y), aux

    def run(**kwargs):
        model = GPT.from_config_seed(GPTConfig.tiny(), 0, ffn_factory=moe_factory(4, k=2, layers=[1]))
        loss = accumulate_gradients(model, x, y, 2, loss_scale=8.0, **kwargs)
        return loss, {n: p.grad for n, p in model.named_parameters()}, model.h[1].ffn.last_stats.balance_loss

    loss, grads, aux = run(loss_fn=gpt_loss)
    assert aux > 0  # the experts' balance loss is in the sum
    want_loss, want_grads, _ = run(loss_mean="mean_of_means")
    assert loss == want_loss
    assert grads.keys() == want_grads.keys() and all(torch.equal(grads[n], want_grads[n]) for n in grads)
    token_loss, token_grads, _ = run()
    assert loss != token_loss and not torch.equal(grads["wte.weight"], token_grads["wte.weight"])


# ------------------------------------------------------------ clipping in a parallel run
CLIP = 0.05  # the tiny GPT's first gradient norm is about 1.5: clipping scales it down


def _sgd_step(model, mesh=None):
    """One train_step with plain SGD (AdamW would hide a rescaled gradient: its first step is
    scale-invariant), on a fixed batch; returns the loss."""
    x, y = synthetic_batch(4, 16, seed=3)
    return train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), x, y, grad_clip=CLIP, mesh=mesh)


def _tensor_parallel_step():
    import torch.distributed as dist

    from reference.mesh import Mesh
    from reference.tensor_parallel import apply_tensor_parallel

    mesh = Mesh(tp=dist.get_world_size()).build_groups()
    model = apply_tensor_parallel(GPT.from_config_seed(GPTConfig.tiny(), 0), mesh)
    try:  # without the mesh each rank would clip by the norm of its own slices
        _sgd_step(apply_tensor_parallel(GPT.from_config_seed(GPTConfig.tiny(), 0), mesh))
        refused = None
    except ValueError as err:
        refused = str(err)
    _sgd_step(model, mesh)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, refused


def test_train_step_clips_by_the_global_norm_on_tensor_parallel_ranks():
    from reference.runtime import launch
    from test_tensor_parallel_gpt import dense_shard  # this rank's slice of a dense tensor

    dense = GPT.from_config_seed(GPTConfig.tiny(), 0)
    _sgd_step(dense)  # one process: torch's clip_grad_norm_
    want = dict(dense.named_parameters())
    for rank, (params, refused) in enumerate(launch(_tensor_parallel_step, 2, backend="gloo", timeout=120, quiet=True)):
        for name, p in params.items():
            # SGD with lr 1 moves each weight by its clipped gradient: fp32, the TP sums in
            # another order, a few ulps apart.
            torch.testing.assert_close(p, dense_shard(name, want[name].detach(), rank, 2, 256),
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
        assert "pass mesh=" in refused and "grad_clip=0.05 inside a run of 2 ranks" in refused
