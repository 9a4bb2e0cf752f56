"""reference.zero.viz draws the numbers it is given; and the measured claims of notebook 02
that tests/test_zero.py and tests/test_memory.py do not already check.

Those two files check stages 1 to 3 against the formulas on 2 and 4 ranks (memory,
bytes per step, parity). Here, on the same sizes: plain data parallelism holds the
stage-0 formula on every rank, FSDP in bf16 holds the 16 bytes of the mixed-precision
formula split 4 + 4 + 8, offload adds a 4-byte compute copy per sharded parameter,
and FSDP never holds more than two blocks whole. Plus the fp16 / bf16 facts the
notebook's loss-scaling section rests on.
"""
import io

import pytest
import torch
import torch.distributed as dist
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from reference import memory
from reference.zero import viz as zero_viz
from reference.data import synthetic_batch
from reference.data_parallel import DDP
from reference.memory import MemoryBytes, Precision, model_state_bytes
from reference.model import GPT, GPTConfig
from reference.runtime import launch
from reference.zero import FSDP

PSI = 1200  # divisible by 2 and 4: the formulas are exact without padding


@pytest.fixture
def no_pyplot_figures():
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    yield
    assert plt.get_fignums() == before


def _render(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


def _texts(ax):
    return [t.get_text() for t in ax.texts]


# ---------------------------------------------------------------------------
# Pictures
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("precision", [Precision.fp32_adam(), Precision.mixed_adam()], ids=["fp32", "mixed"])
def test_zero_stages_draws_each_ranks_share_and_the_formula(dp, precision, no_pyplot_figures):
    fig = zero_viz.plot_zero_stages(dp, precision)
    assert isinstance(fig, Figure) and len(fig.axes) == 4
    total = precision.param + precision.grad + precision.optimizer
    for stage, ax in enumerate(fig.axes):
        # Bytes per parameter held by a rank, read back from the outlined (held) patches.
        held = {}
        for patch in ax.patches:
            if patch.get_edgecolor()[:3] == (0.0, 0.0, 0.0):  # the rank's own, in full colour
                rank = int(patch.get_y())
                held[rank] = held.get(rank, 0.0) + patch.get_width()
        want = model_state_bytes(PSI * dp, dp, stage, precision).model_states / (PSI * dp)
        assert sorted(held) == list(range(dp))
        assert all(h == pytest.approx(want) for h in held.values()), (stage, held, want)
        assert f"= {want:.3g} Ψ bytes" in _texts(ax)[0]
        # Optimizer state, sharded from stage 1 on: rank r owns the slice starting at r/N of
        # it, so the ranks' slices tile it with no byte held twice.
        k0, k = precision.param + precision.grad, precision.optimizer
        owned = sorted((int(p.get_y()), p.get_x()) for p in ax.patches
                       if p.get_edgecolor()[:3] == (0.0, 0.0, 0.0) and p.get_x() >= k0)
        if stage == 0:
            assert owned == [(r, k0) for r in range(dp)]
        else:
            assert owned == [(r, pytest.approx(k0 + k * r / dp)) for r in range(dp)]
    assert f"{precision.param} + {precision.grad} + {precision.optimizer}" in fig.get_suptitle()
    assert fig.axes[-1].get_xlim()[1] > total
    _render(fig)


def _bar_heights(ax):
    return [p.get_height() for p in ax.patches]


def test_memory_per_rank_bars_are_the_bytes_given(no_pyplot_figures):
    measured = {f"N = {n}": {name: model_state_bytes(PSI, n, s) for s, name in enumerate(["DDP", "Z1", "Z2", "Z3"])}
                for n in (2, 4)}
    formula = {panel: dict(bars) for panel, bars in measured.items()}
    formula["N = 4"]["Z3"] = MemoryBytes(1, 2, 3)  # one deliberate mismatch
    fig = zero_viz.plot_memory_per_rank(measured, formula, title="t")
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes] == ["N = 2", "N = 4"]
    for ax, (panel, bars) in zip(axes, measured.items()):
        heights = _bar_heights(ax)
        want = []
        for name, mem in bars.items():  # measured stack, then formula stack, per bar
            want += [mem.params, mem.grads, mem.optimizer_state]
            f = formula[panel][name]
            want += [f.params, f.grads, f.optimizer_state]
        assert heights == want
        labels = _texts(ax)
        assert len(labels) == 4
        if panel == "N = 2":
            assert all(label.endswith("= formula") for label in labels)
        else:
            assert [label.endswith("= formula") for label in labels] == [True, True, True, False]
            assert labels[-1].endswith("formula 6 B")
    _render(fig)
    alone = zero_viz.plot_memory_per_rank({"p": {"a": MemoryBytes(4, 4, 8)}})
    assert _bar_heights(alone.axes[0]) == [4, 4, 8]
    with pytest.raises(ValueError, match="same panels and bars"):
        zero_viz.plot_memory_per_rank(measured, {"N = 2": formula["N = 2"]})
    with pytest.raises(ValueError, match="measured is empty"):
        zero_viz.plot_memory_per_rank({})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_calculator_figure_is_the_formula(stage, no_pyplot_figures):
    psi, dp, precision = 7_500_000_000, 64, Precision.mixed_adam()
    fig = zero_viz.plot_memory_calculator(psi, dp, stage, precision, device_bytes=80e9)
    left, right = fig.axes
    chosen = model_state_bytes(psi, dp, stage, precision)
    assert _bar_heights(left) == [chosen.params, chosen.grads, chosen.optimizer_state]
    stacks = _bar_heights(right)
    for s in range(4):
        mem = model_state_bytes(psi, dp, s, precision)
        assert stacks[3 * s:3 * s + 3] == [mem.params, mem.grads, mem.optimizer_state]
    assert any(line.get_ydata()[0] == 80e9 for line in right.get_lines())  # the device line
    # The ZeRO paper's figure 1 numbers, as the figure writes them.
    assert _texts(right)[:4] == ["120 GB", "31.4 GB", "16.6 GB", "1.88 GB"]
    _render(fig)
    with pytest.raises(ValueError, match="stage must be 0"):
        zero_viz.plot_memory_calculator(psi, dp, 4)


def test_unit_residency_fills_the_whole_units(no_pyplot_figures):
    steps = [("gather root", [True, False, False]), ("prefetch block 0", [True, True, False]),
             ("free root", [False, True, False])]
    fig = zero_viz.plot_unit_residency(steps, ["root", "block 0", "block 1"])
    ax = fig.axes[0]
    assert len(ax.patches) == 3 * 3  # one cell per (event, unit)
    filled = {(int(p.get_x()), int(p.get_y())) for p in ax.patches
              if p.get_facecolor() == to_rgba("tab:blue")}
    assert filled == {(0, 0), (1, 0), (1, 1), (2, 1)}  # (event, unit) where the unit is whole
    assert [t.get_text() for t in ax.get_xticklabels()] == [label for label, _ in steps]
    assert "at most 2 of 3" in ax.get_title()
    _render(fig)
    with pytest.raises(ValueError, match="has 2 flags for 3 units"):
        zero_viz.plot_unit_residency([("x", [True, False])], ["a", "b", "c"])
    with pytest.raises(ValueError, match="steps is empty"):
        zero_viz.plot_unit_residency([], ["a"])


# ---------------------------------------------------------------------------
# Claims of notebook 02, measured on 2 and 4 ranks
# ---------------------------------------------------------------------------
CONFIG = GPTConfig.tiny()  # every FSDP unit divides by 2 and 4: no padding
LR = 1e-3


def _batch(step, rank, world):
    x, y = synthetic_batch(8, CONFIG.block_size, seed=7, step=step)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    return x[rows], y[rows]


def _one_step(runner, opt):
    _, loss = runner(*_batch(0, dist.get_rank(), dist.get_world_size()))
    loss.backward()
    opt.step()
    return memory.measure(runner, opt)  # parameters, gradients and state all held


def _residency():
    """The most blocks whole at any gather/free, and the bytes still gathered after backward."""
    model = GPT.from_config_seed(GPTConfig.tiny(n_layer=4), 0)
    fsdp = FSDP(model)
    peak = [0]

    def count():
        peak[0] = max(peak[0], sum(u.full.untyped_storage().nbytes() > 0 for u in fsdp.block_units))

    for unit in fsdp.units:
        for method in ("gather", "free"):
            inner = getattr(unit, method)
            setattr(unit, method, lambda *a, inner=inner, **k: (inner(*a, **k), count())[0])
    _, loss = fsdp(*_batch(0, dist.get_rank(), dist.get_world_size()))
    loss.backward()
    return peak[0], [u.full.untyped_storage().nbytes() for u in fsdp.units]


def _claims():
    out = {}
    model = GPT.from_config_seed(CONFIG, 0)
    ddp = DDP(model)
    out["ddp"] = _one_step(ddp, torch.optim.AdamW(model.parameters(), lr=LR))
    out["ddp_buffers"] = sum(4 * b.numel for b in ddp.buckets)
    fsdp = FSDP(GPT.from_config_seed(CONFIG, 0), mixed_precision=True)
    out["bf16"] = _one_step(fsdp, torch.optim.AdamW(fsdp.parameters(), lr=LR))
    fsdp = FSDP(GPT.from_config_seed(CONFIG, 0), offload=True)
    out["offload"] = _one_step(fsdp, torch.optim.AdamW(fsdp.parameters(), lr=LR))
    out["compute_copies"] = sum(u.compute_shard.numel() * u.compute_shard.element_size() for u in fsdp.units)
    out["separate"] = all(u.compute_shard.data_ptr() != u.shard.data_ptr() for u in fsdp.units)
    out["peak_blocks"], out["left_gathered"] = _residency()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"dp{n}")
def claims(request):
    return request.param, launch(_claims, request.param, backend="gloo", timeout=180, quiet=True)  # CPU tensors


def test_data_parallel_memory_does_not_shrink_with_ranks(claims):
    n, results = claims
    psi = GPT.from_config_seed(CONFIG, 0).num_parameters()
    for res in results:
        got = res["ddp"]
        assert (got.params, got.grads, got.optimizer_state) == (4 * psi, 4 * psi, 8 * psi)
        assert got.model_states == model_state_bytes(psi, n, 0).model_states == 16 * psi
        # DDP's flat bucket buffers: another 4 Psi, outside the formula
        assert res["ddp_buffers"] == 4 * psi


def test_fsdp_mixed_precision_holds_16_bytes_split_4_4_8(claims):
    n, results = claims
    psi = GPT.from_config_seed(CONFIG, 0).num_parameters()
    mixed = model_state_bytes(psi, n, 3, Precision.mixed_adam())
    for res in results:
        got = res["bf16"]
        assert got.model_states == mixed.model_states == 16 * psi // n
        assert (got.params, got.grads, got.optimizer_state) == (4 * psi // n, 4 * psi // n, 8 * psi // n)


def test_offload_adds_a_compute_copy_on_a_cpu_only_machine(claims):
    n, results = claims
    psi = GPT.from_config_seed(CONFIG, 0).num_parameters()
    for res in results:
        assert res["offload"].model_states == 16 * psi // n
        assert res["compute_copies"] == 4 * psi // n and res["separate"]


def test_fsdp_holds_at_most_two_blocks_whole(claims):
    n, results = claims
    for res in results:
        assert res["peak_blocks"] == 2  # the block computing and the one prefetched
        assert res["left_gathered"] == [0] * 5  # root and 4 blocks all freed after backward


def test_loss_scaling_facts():
    # An update of 1e-3 to a weight of 1 is lost in bf16: why master weights stay fp32.
    assert (torch.tensor(1.0).bfloat16() + torch.tensor(1e-3).bfloat16()).item() == 1.0
    assert torch.finfo(torch.bfloat16).tiny == torch.finfo(torch.float32).tiny
    assert torch.finfo(torch.float16).max == 65504
    # Magnitudes spread log-uniformly over 1e-12 .. 1e-2, as in the notebook.
    grads = 10 ** torch.empty(100_000, dtype=torch.float64).uniform_(
        -12, -2, generator=torch.Generator().manual_seed(0))
    lost = (grads.to(torch.float16) == 0).double().mean().item()
    # Below 2**-25 (half the smallest fp16 subnormal) rounds to 0: log10(2**-25) = -7.53,
    # so (12 - 7.53) / 10 = 44.7 % of the log range.
    assert lost == pytest.approx(0.447, abs=0.01)
    scaled = (grads * 2 ** 16).to(torch.float16)
    assert (scaled == 0).sum() == 0 and not scaled.isinf().any()
    over = (grads * 2 ** 24).to(torch.float16)
    assert over.isinf().double().mean().item() == pytest.approx(0.041, abs=0.01)
    assert (grads.to(torch.bfloat16) == 0).sum() == 0
