"""The schedule explorer draws headless and follows its controls; and the claims of
notebook 04 that no other test measures: the messages interleaving adds, the
parameters per stage once the embedding and the head get stages of their own, and
the extra forward that activation checkpointing costs. No process is started."""
import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from reference.data import synthetic_batch
from reference.model import GPT, GPTConfig
from reference.pipeline_parallel import (bubble_formula, build_schedule, plan_stages, run_pipeline,
                                         split_stages)
from reference.pipeline_parallel.widgets import MAX_M, MAX_PP, ScheduleExplorer, schedule_explorer


def _boxes(fig):
    return [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]


def test_explorer_draws_without_a_frontend():
    ex = schedule_explorer(kind="1f1b", pp=4, m=8)
    assert isinstance(ex, ScheduleExplorer)
    assert isinstance(ex.figure, Figure)
    assert len(_boxes(ex.figure)) == 2 * 4 * 8  # one F and one B per micro-batch and rank
    assert ex.image.value[:4] == b"\x89PNG"
    assert ex.bubble == pytest.approx(bubble_formula("1f1b", 4, 8), abs=1e-12)
    assert ex.bubble == pytest.approx(3 / 11, abs=1e-12)
    summary = ex.summary.value
    assert "bubble <b>27.3%</b>" in summary and "(p-1)/(m+p-1) = 27.3%" in summary
    assert "rank 0 to 3: 4, 3, 2, 1" in summary  # 1F1B holds pp - r micro-batches
    assert "48 point-to-point messages" in summary  # 2 m (p - 1): each activation and its gradient
    assert ex.virtual.disabled  # 1F1B has one chunk per rank
    assert repr(ex) == "ScheduleExplorer(kind='1f1b', pp=4, m=8, virtual=1)"


def test_changing_a_control_redraws():
    ex = schedule_explorer(kind="gpipe", pp=4, m=8)
    gpipe_fig, gpipe_bubble = ex.figure, ex.bubble
    assert "rank 0 to 3: 8, 8, 8, 8" in ex.summary.value  # GPipe holds all m on every rank
    ex.kind.value = "interleaved"  # an observer calls update()
    assert not ex.virtual.disabled
    assert ex.figure is not gpipe_fig
    assert len(_boxes(ex.figure)) == 2 * 4 * 8 * 2
    assert ex.bubble == pytest.approx(3 / 19, abs=1e-12) and ex.bubble < gpipe_bubble
    ex.virtual.value = 4
    assert ex.bubble == pytest.approx(bubble_formula("interleaved", 4, 8, 4), abs=1e-12)
    assert f"{2 * 8 * (4 * 4 - 1)} point-to-point messages" in ex.summary.value
    ex.m.value = 2  # fewer micro-batches than ranks: the other formula
    assert "1 - vm/(vp+m-1)" in ex.summary.value
    assert ex.bubble == pytest.approx(bubble_formula("interleaved", 4, 2, 4), abs=1e-12)
    ex.kind.value = "naive"
    assert ex.virtual.disabled and ex.settings == ("naive", 4, 2, 1)
    assert ex.bubble == pytest.approx(3 / 4, abs=1e-12)
    ex.pp.value = 1  # a pipeline of one rank never idles
    assert ex.bubble == 0.0 and len(_boxes(ex.figure)) == 2 * 2


def test_a_combination_that_cannot_run_is_reported_not_raised():
    ex = schedule_explorer(kind="interleaved", pp=4, m=8, virtual=2)
    ex.m.value = 6
    assert ex.schedule is None and ex.figure is None and ex.bubble is None
    assert "multiple of pp=4" in ex.error and "multiple of pp=4" in ex.summary.value
    assert ex.image.value == b""
    assert ex.update() is None
    ex.m.value = 3  # fewer than pp: runs again
    assert ex.error is None and isinstance(ex.figure, Figure)
    ex.pp.value = 1
    assert "pp >= 2" in ex.error


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="kind must be one of naive, gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, "
                                         "dualpipev, got 'zb'"):
        schedule_explorer(kind="zb")
    with pytest.raises(ValueError, match=f"pp must be an int from 1 to {MAX_PP}, got 9"):
        schedule_explorer(pp=9)
    with pytest.raises(ValueError, match=f"m must be an int from 1 to {MAX_M}, got 0"):
        schedule_explorer(m=0)
    with pytest.raises(ValueError, match="virtual must be an int from 2 to 4, got 1"):
        schedule_explorer(virtual=1)


def test_the_zero_bubble_schedules_draw_their_i_and_w():
    """F, I and W of every micro-batch and chunk as boxes; the bubble against its closed form, or
    the timeline's where there is none (ZB-V below m = 2p - 1); DualPipeV's m >= 2p refused."""
    for kind, v in (("zb-h1", 1), ("zb-v", 2)):
        ex = schedule_explorer(kind=kind, pp=4, m=8)
        assert ex.settings == (kind, 4, 8, v) and ex.virtual.disabled
        assert len(_boxes(ex.figure)) == 3 * 4 * 8 * v
        assert f"= {ex.bubble:.1%})" in ex.summary.value and "(p-1)/(" in ex.summary.value
    ex = schedule_explorer(kind="zb-v", pp=4, m=3)
    assert "none in closed form here" in ex.summary.value
    ex.kind.value = "dualpipev"
    assert "needs at least as many micro-batches as stages" in ex.error
    ex.m.value = 8
    assert ex.error is None and "held at the peak, rank 0 to 3: 9, 9, 9, 9" in ex.summary.value


@pytest.mark.parametrize("pp, m, v", [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 8, 4)])
def test_interleaving_sends_more_messages(pp, m, v):
    """Notebook 04: every boundary between stages carries each micro-batch's activation
    one way and its gradient back, so 2 m (p v - 1) messages instead of 2 m (p - 1)."""
    def messages(s):
        return sum(a.op.startswith("SEND") for r in range(pp) for a in s.actions(r))

    assert messages(build_schedule("1f1b", pp, m)) == 2 * m * (pp - 1)
    assert messages(build_schedule("interleaved", pp, m, v)) == 2 * m * (pp * v - 1)


def test_embedding_and_head_stages_balance_the_parameters():
    """Notebook 04's example: a vocabulary of 1024 makes the embedding (and the tied
    head's copy) weigh more than two blocks. Counted on the built stages."""
    cfg = GPTConfig.tiny(n_layer=6, n_embd=32, vocab_size=1024)
    model = GPT.from_config_seed(cfg, 0)

    def per_stage(**kw):
        return [sum(p.numel() for p in s.parameters()) for s in split_stages(model, 4, **kw)]

    plain = per_stage()
    own = per_stage(embedding_stage=True, head_stage=True)
    assert [str(s) for s in plan_stages(cfg, 4, embedding_stage=True, head_stage=True)] == [
        "stage 0: embedding", "stage 1: blocks 0..2", "stage 2: blocks 3..5", "stage 3: head"]
    # every parameter is on one stage, the tied matrix on two (one copy each end)
    tied = model.wte.weight.numel()
    assert sum(plain) == sum(own) == sum(p.numel() for p in model.parameters()) + tied
    assert max(plain) / min(plain) > 4  # the ends hold the big matrices, and a block each
    assert max(own) / min(own) < 1.2
    assert max(own) < 0.7 * max(plain)  # the slowest stage, which sets the pipeline's pace
    # the embedding alone on its stage is not enough: the head's end stays heavy
    assert max(per_stage(embedding_stage=True)) == max(plain)
    # balancing by parameter count finds the same cut by itself
    assert per_stage(balance="params") == own


def _forward_calls(checkpoint: bool, m: int = 4) -> int:
    """Forwards of the stage in one 1F1B step of a one-rank pipeline (no process group)."""
    cfg = GPTConfig.tiny(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64)
    stages = split_stages(GPT.from_config_seed(cfg, 0), 1)
    calls = []
    stages[0].register_forward_hook(lambda *_: calls.append(1))
    x, y = synthetic_batch(m, 8, cfg.vocab_size)
    run_pipeline(build_schedule("1f1b", 1, m), stages, x, y, checkpoint=checkpoint)
    return len(calls)


def test_checkpointing_costs_one_more_forward_per_micro_batch():
    """Notebook 04: recomputation runs each micro-batch's forward a second time, nothing more."""
    assert _forward_calls(False) == 4
    assert _forward_calls(True) == 2 * 4

