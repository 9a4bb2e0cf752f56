"""Cutting the GPT into stages, and the executor on a single rank (pp = 1), in one process."""
import itertools

import pytest

from reference.data import synthetic_batch
from reference.model import GPT, GPTConfig
from reference.pipeline_parallel import (DelayedStage, GPTStage, build_schedule, local_stages,
                                         plan_stages, run_pipeline, split_stages, sync_tied_grads)
from reference.tolerance import exact, gradient, loss
from reference.train.single import accumulate_gradients

LOSS_TOL = loss()  # the course's policy (reference.tolerance): a loss summed in another order


def _blocks(specs):
    return [len(s.layers) for s in specs]


def test_layers_are_dealt_evenly_extra_ones_to_the_later_stages():
    cfg = GPTConfig.tiny(n_layer=5)
    specs = plan_stages(cfg, 2)
    assert _blocks(specs) == [2, 3]
    assert [(s.embedding, s.head) for s in specs] == [(True, False), (False, True)]
    assert _blocks(plan_stages(cfg, 4)) == [1, 1, 1, 2]
    assert [str(s) for s in plan_stages(cfg, 3, embedding_stage=True, head_stage=True)] == [
        "stage 0: embedding", "stage 1: blocks 0..4", "stage 2: head"]
    specs = plan_stages(cfg, 4, embedding_stage=True)
    assert _blocks(specs) == [0, 1, 2, 2] and specs[0].embedding and specs[-1].head
    # contiguous, in order, every block once
    for n in range(1, 6):
        layers = [i for s in plan_stages(cfg, n) for i in s.layers]
        assert layers == list(range(5))


def test_params_balance_finds_the_best_contiguous_cut():
    # a large vocabulary: the embedding and the head each weigh several blocks
    cfg = GPTConfig.tiny(n_layer=6, n_embd=32, vocab_size=2048)
    model = GPT.from_config_seed(cfg, 0)
    emb = model.wte.weight.numel() + model.wpe.weight.numel()
    block = sum(p.numel() for p in model.h[0].parameters())
    head = model.lm_head.weight.numel() + sum(p.numel() for p in model.ln_f.parameters())
    costs = [emb] + [block] * 6 + [head]

    def load(specs):
        return max((emb if s.embedding else 0) + block * len(s.layers) + (head if s.head else 0)
                   for s in specs)

    for n in (2, 3, 4):
        specs = plan_stages(model, n, balance="params")
        assert plan_stages(cfg, n, balance="params") == specs  # from the config alone, same cut
        best = min(max(sum(costs[a:b]) for a, b in zip((0,) + cuts, cuts + (len(costs),)))
                   for cuts in itertools.combinations(range(1, len(costs)), n - 1))
        assert load(specs) == best
        assert load(specs) <= load(plan_stages(model, n, balance="layers"))
    assert str(plan_stages(model, 4, balance="params")[0]) == "stage 0: embedding"


def test_impossible_cuts_name_the_numbers():
    with pytest.raises(ValueError, match="cannot cut 2 blocks into 3 stages"):
        plan_stages(GPTConfig.tiny(n_layer=2), 3)
    with pytest.raises(ValueError, match="embedding_stage=True, head_stage=True"):
        plan_stages(GPTConfig.tiny(n_layer=2), 2, embedding_stage=True, head_stage=True)
    with pytest.raises(ValueError, match="balance must be"):
        plan_stages(GPTConfig.tiny(), 2, balance="flops")
    with pytest.raises(ValueError, match="do not deal out over pp=3"):
        local_stages(split_stages(GPT.from_config_seed(GPTConfig.tiny(n_layer=4), 0), 4), 3, 0)


def test_stages_share_the_model_and_compose_to_it():
    model = GPT.from_config_seed(GPTConfig.tiny(n_layer=4), 0)
    stages = split_stages(model, 2, virtual=2, embedding_stage=True)
    assert all(isinstance(s, GPTStage) for s in stages)
    names = dict(model.named_parameters(remove_duplicate=False))
    for s in stages:
        for n, p in s.named_parameters():
            assert p is names[n]  # the model's own tensors, under the model's own names
    x, _ = synthetic_batch(2, 16, 256)
    h = x
    for s in stages:
        h, aux = s(h)
        assert aux.shape == ()
    logits, _ = model(x)
    exact().assert_close(h, logits, "the stages' output against the model's")
    assert [s.spec.stage for s in local_stages(stages, 2, 1)] == [1, 3]


@pytest.mark.parametrize("kind, m, ckpt", [("gpipe", 4, False), ("1f1b", 2, True), ("naive", 4, True)])
def test_one_rank_pipeline_is_gradient_accumulation(kind, m, ckpt):
    """pp = 1 needs no process group: m micro-batches on one stage sum to the full batch's gradient."""
    cfg = GPTConfig.tiny(n_layer=2)
    x, y = synthetic_batch(4, 16, 256, seed=2)
    ref = GPT.from_config_seed(cfg, 0)
    loss = accumulate_gradients(ref, x, y)  # one process, the full batch
    model = GPT.from_config_seed(cfg, 0)
    stages = split_stages(model, 1)
    result = run_pipeline(build_schedule(kind, 1, m), stages, x, y, checkpoint=ckpt)
    LOSS_TOL.assert_close(result.loss, loss, "loss")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        gradient(m).assert_close(p.grad, q.grad, n)  # summed over the m micro-batches
    assert [str(e.action) for e in result.trace] == [str(a) for a in build_schedule(kind, 1, m).actions(0)]
    assert sync_tied_grads(stages, None) == 0  # one process holds both ends of the tied weight


def test_delayed_stage_changes_time_not_results():
    cfg = GPTConfig.tiny(n_layer=1)
    x, y = synthetic_batch(2, 8, 256)
    a, b = GPT.from_config_seed(cfg, 0), GPT.from_config_seed(cfg, 0)
    plain = run_pipeline(build_schedule("gpipe", 1, 2), split_stages(a, 1), x, y)
    slow = run_pipeline(build_schedule("gpipe", 1, 2),
                        [DelayedStage(s, 0.01, 0.02) for s in split_stages(b, 1)], x, y)
    exact().assert_close(plain.loss, slow.loss, "loss")
    for p, q in zip(a.parameters(), b.parameters()):
        exact().assert_close(p.grad, q.grad, "gradient")
    # every forward sleeps 0.01 s and every backward 0.02 s on top of its compute
    for e in slow.trace:
        assert e.end - e.start >= {"F": 0.01, "B": 0.02}[e.action.op]


def test_executor_input_errors():
    model = GPT.from_config_seed(GPTConfig.tiny(n_layer=2), 0)
    x, y = synthetic_batch(6, 8, 256)
    with pytest.raises(ValueError, match="6 sequences does not split into m=4"):
        run_pipeline(build_schedule("gpipe", 1, 4), split_stages(model, 1), x, y)
    with pytest.raises(ValueError, match="virtual=1 chunks per rank, got 2 stages"):
        run_pipeline(build_schedule("gpipe", 1, 2), split_stages(model, 2), x, y)
    with pytest.raises(ValueError, match="should run model stage 0 of 1"):
        run_pipeline(build_schedule("gpipe", 1, 2), split_stages(model, 2)[1:], x, y)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        run_pipeline(build_schedule("gpipe", 2, 2), split_stages(model, 2)[:1], x, y)
    with pytest.raises(ValueError, match="one flag per chunk"):
        run_pipeline(build_schedule("gpipe", 1, 2), split_stages(model, 1), x, y,
                     checkpoint=[True, False])
