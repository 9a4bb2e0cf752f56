"""reference.zero.widgets: the memory calculator works with no frontend and shows the formula.

Building the widget and calling `update()` must draw the figure headless (as when
notebook 02 runs under papermill); every control's change must redraw; the numbers
it shows are `reference.memory.model_state_bytes`. The last test holds the numbers
notebook 02 quotes when it checks the article's claim about a 65B model.
"""
from fractions import Fraction

import pytest
from matplotlib.figure import Figure

from reference.zero import widgets
from reference.memory import Precision, model_state_bytes

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def no_pyplot_figures():
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    yield
    assert plt.get_fignums() == before


def _stacks(calc):
    """Bar heights of the right panel: params, grads, state for stages 0..3."""
    return [p.get_height() for p in calc.figure.axes[1].patches]


def test_builds_and_updates_headless(no_pyplot_figures):
    calc = widgets.memory_calculator(num_params=7.5e9, dp=64, stage=3, precision="mixed")
    assert isinstance(calc, widgets.MemoryCalculator)
    fig = calc.update()
    assert isinstance(fig, Figure) and fig is calc.figure
    assert calc.image.value[:8] == PNG  # the picture travels as PNG bytes, no frontend needed
    # The ZeRO paper's figure 1: 7.5B parameters, mixed precision, 64 ranks.
    assert "<b>1.88 GB</b> per rank" in calc.summary.value
    assert "fits in one 80 GB device" in calc.summary.value
    assert calc.bytes_per_rank() == model_state_bytes(7_500_000_000, 64, 3, Precision.mixed_adam())
    assert repr(calc) == ("MemoryCalculator(num_params=7.5e+09, dp=64, stage=3, "
                          "precision='mixed', device='80 GB')")


@pytest.mark.parametrize("control, value, stage, dp, precision", [
    ("stage", 0, 0, 64, "mixed"),
    ("dp", 8, 3, 8, "mixed"),
    ("precision", "fp32", 3, 64, "fp32"),
])
def test_every_control_redraws_with_the_formula(control, value, stage, dp, precision, no_pyplot_figures):
    calc = widgets.memory_calculator(num_params=7.5e9, dp=64, stage=3, precision="mixed")
    before_fig, before_png = calc.figure, calc.image.value
    getattr(calc, control).value = value  # as a user moving the control
    assert calc.figure is not before_fig and calc.image.value != before_png
    prec = widgets.PRECISIONS[precision][1]
    want = model_state_bytes(7_500_000_000, dp, stage, prec)
    assert calc.bytes_per_rank() == want
    left = [p.get_height() for p in calc.figure.axes[0].patches]
    assert left == [want.params, want.grads, want.optimizer_state]
    for s in range(4):
        mem = model_state_bytes(7_500_000_000, dp, s, prec)
        assert _stacks(calc)[3 * s:3 * s + 3] == [mem.params, mem.grads, mem.optimizer_state]


def test_model_size_and_device_controls(no_pyplot_figures):
    calc = widgets.memory_calculator(num_params=1e9, dp=1, stage=0, precision="fp32", device="24 GB")
    assert "<b>16 GB</b> per rank; fits in one 24 GB device" in calc.summary.value
    calc.num_params.value = 1e10
    assert "<b>160 GB</b> per rank; does not fit in one 24 GB device" in calc.summary.value
    calc.device.value = "none"
    assert "device" not in calc.summary.value
    assert not calc.figure.axes[1].get_lines()  # no device line drawn


def test_bad_settings_are_explained():
    with pytest.raises(ValueError, match="stage must be 0"):
        widgets.memory_calculator(stage=4)
    with pytest.raises(ValueError, match="precision must be one of"):
        widgets.memory_calculator(precision="fp8")
    with pytest.raises(ValueError, match="dp must be a positive int"):
        widgets.memory_calculator(dp=0)
    with pytest.raises(ValueError, match="device must be one of"):
        widgets.memory_calculator(device="1 TB")
    with pytest.raises(ValueError, match="num_params must be between"):
        widgets.memory_calculator(num_params=10)


def test_the_65b_claim_numbers():
    # Notebook 02 checks "embedding stage + ZeRO-3 took a 65B model from 480 GB to 320 GB".
    psi, mixed = 65_000_000_000, Precision.mixed_adam()
    total = model_state_bytes(psi, 1, 0, mixed).model_states
    assert total == 1_040_000_000_000 > 2 * 480e9  # 480 GB cannot hold the whole job's model states
    # N = 3 does not divide 65e9: the shards are padded by one number, hence approx there.
    per_rank = {n: [model_state_bytes(psi, n, s, mixed).model_states for s in range(4)] for n in (2, 4, 5, 8)}
    assert per_rank[8] == [1_040e9, 357.5e9, 243.75e9, 130e9]
    for n, (ddp, z1, z2, z3) in per_rank.items():
        assert Fraction(z3, ddp) == Fraction(1, n)                    # ZeRO-3 vs DDP: 1/N
        assert Fraction(z3, z2) == Fraction(16, 2 * n + 14)           # vs ZeRO-2
        assert Fraction(z3, z1) == Fraction(16, 4 * n + 12)           # vs ZeRO-1
    assert Fraction(per_rank[5][3], per_rank[5][2]) == Fraction(2, 3)  # a one-third cut at N = 5
    z1, z3 = (model_state_bytes(psi, 3, s, mixed).model_states for s in (1, 3))
    assert z3 / z1 == pytest.approx(2 / 3, rel=1e-9)                    # and against ZeRO-1 at N = 3
    embedding = 32_000 * 8192  # a 32k vocabulary at width 8192
    assert round(embedding / psi, 3) == 0.004 and round(16 * embedding / 1e9, 1) == 4.2
    assert 16 * embedding < (480e9 - 320e9) / 30  # far from the 160 GB saved


def test_toggle_buttons_are_as_wide_as_their_labels(no_pyplot_figures):
    """The default ToggleButtons width (about 90 px) cut the precision labels in JupyterLab."""
    calc = widgets.memory_calculator()
    longest = max(len(label) for label, _ in calc.precision.options)
    assert longest > 12  # a label that does not fit the default width
    assert calc.precision.style.button_width == "auto" and calc.stage.style.button_width == "auto"
