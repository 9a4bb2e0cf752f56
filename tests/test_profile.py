"""profile_step: a trace per rank, the step's time split into compute, communication and idle
(adding up to the step), waiting for a late peer counted as communication, and MFU."""
import json
import time

import pytest
import torch
import torch.distributed as dist

from reference.model import GPT, GPTConfig
from reference.profile import (measure_matmul_peak, mfu, plot_profile, profile_step,
                               training_flops)
from reference.runtime import launch


def _ddp_step(trace_dir):
    from reference.data_parallel import DDP

    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig.tiny()), bucket_cap_mb=0.01)
    idx = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))

    def step():
        model(idx, idx)[1].backward()
        model.finish_gradient_synchronization()

    step()  # warm up
    return profile_step(step, trace_dir=trace_dir)


def _late_peer():
    def step():
        x = torch.ones(1000)
        if dist.get_rank() == 1:
            time.sleep(0.3)  # rank 0 waits in its all-reduce
        dist.all_reduce(x)
    return profile_step(step)


def test_a_ddp_step_is_split_into_compute_communication_and_idle(tmp_path):
    summaries = launch(_ddp_step, 2, str(tmp_path), timeout=120)
    for s in summaries:
        assert s.compute > 0 and s.communication.get("all_reduce", 0) > 0
        parts = s.compute + s.communication_total + s.idle
        assert parts == pytest.approx(s.step, rel=1e-9, abs=1e-9)  # the parts add up to the step
        trace = json.loads(open(s.trace_path).read())
        assert trace["traceEvents"]  # a Chrome/Perfetto trace per rank
    assert plot_profile(summaries).axes


def test_waiting_for_a_late_peer_counts_as_communication():
    early, late = launch(_late_peer, 2, timeout=60)
    assert early.communication["all_reduce"] > 0.2 > late.communication["all_reduce"]
    assert early.communication_share > 0.5


def test_flops_and_mfu():
    cfg = GPTConfig.tiny()
    n = GPT(cfg).num_parameters()
    flops = training_flops(n, tokens=4 * 32, n_layer=cfg.n_layer, seq_len=32, n_embd=cfg.n_embd)
    assert flops == 128 * (6 * n + 12 * cfg.n_layer * 32 * cfg.n_embd)
    peak = measure_matmul_peak(256, repeats=3)
    assert peak > 1e8  # any CPU does 0.1 GFLOP/s
    assert 0 < mfu(flops, 1.0, peak) < 1


def _hidden_and_blocking():
    x, a = torch.ones(1 << 21), torch.randn(192, 192)   # 8 MiB to all-reduce; matmuls to hide it under

    def overlapped():
        work = dist.all_reduce(x, async_op=True)         # on gloo's thread while the matmuls run
        for _ in range(40):
            a @ a
        work.wait()

    def blocking():
        dist.all_reduce(x)                                # the main thread waits in it
        for _ in range(40):
            a @ a

    overlapped()
    return profile_step(overlapped), profile_step(blocking)


def test_communication_under_computation_is_hidden_and_blocking_communication_is_not():
    results = launch(_hidden_and_blocking, 2, timeout=120)
    for overlapped, blocking in results:
        # A blocking call is never under compute (to the profiler's microsecond clock).
        assert blocking.hidden < 1e-5 and blocking.overlap < 0.01
        for s in (overlapped, blocking):
            assert s.compute + s.communication_total + s.idle == pytest.approx(s.step, rel=1e-9, abs=1e-9)
            assert s.overlap == pytest.approx(s.hidden / (s.hidden + s.communication_total))
    # The asynchronous all-reduce ran under the matmuls (on at least one rank: the two ranks
    # share two cores with gloo's threads, so either may be descheduled for a while).
    assert max(o.hidden for o, _ in results) > 0


def test_plot_profile_names_its_bars():
    from reference.profile import ProfileSummary
    parts = [ProfileSummary(0, 1.0, 0.5, {"all_reduce": 0.3}, 0.2), ProfileSummary(0, 1.0, 0.8, {}, 0.2)]
    fig = plot_profile(parts, labels=["naive", "buckets"])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["naive", "buckets"]


def test_plot_profile_labels_stay_clear_of_the_legend_and_inside_the_axes():
    """The "% comm" label at the end of the longest bar neither runs into the legend nor
    past the axes, whatever the number of bars."""
    from reference.profile import ProfileSummary, plot_comm_shares
    for rows in (1, 2, 8):
        parts = [ProfileSummary(r, 1.0, 0.4, {"all_reduce": 0.3, "send": 0.1}, 0.2) for r in range(rows)]
        fig = plot_profile(parts)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)
        ax = fig.axes[0]
        legend = fig.legends[0].get_window_extent(renderer)
        box = ax.get_window_extent(renderer)
        for text in ax.texts:
            extent = text.get_window_extent(renderer)
            assert not extent.overlaps(legend), (rows, text.get_text())
            assert extent.x1 <= box.x1 + 1, (rows, text.get_text())
        assert [t.get_text() for t in fig.legends[0].get_texts()] == ["compute", "all_reduce", "send", "idle"]
    fig = plot_comm_shares(["a", "b"], [0.5, 0.1])
    assert len(fig.axes[0].patches) == 2 and fig.axes[0].texts[0].get_text() == "30%"
