"""The tensor-parallel pictures: the layout they draw is the one the layers use, and
every value passed in is drawn where it belongs. No processes are started."""
import io

import pytest
import torch
from matplotlib.figure import Figure

from reference.tensor_parallel import column_shard, row_shard
from reference.tensor_parallel.viz import KINDS, plot_activation_memory, plot_matrix_split, split_layout


@pytest.fixture
def no_pyplot_figures():
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    yield
    assert plt.get_fignums() == before
    plt.close("all")


def _render(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


def _by_gid(fig):
    """gid -> artist, for every artist of the figure that has one."""
    found = {}
    for ax in fig.axes:
        for artist in [*ax.patches, *ax.lines]:
            if artist.get_gid():
                assert artist.get_gid() not in found, f"gid {artist.get_gid()} drawn twice"
                found[artist.get_gid()] = artist
    return found


def _extent(sl, size):
    start, stop, _ = sl.indices(size)
    return start, stop


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_layout_is_the_layers_split(tp):
    t, k, n = 3, 8, 12
    weight = torch.arange(n * k, dtype=torch.float32).view(n, k)  # nn.Linear's (out, in) = A^T
    A = weight.T  # (k, n)
    for kind in KINDS:
        layout = split_layout(kind, tp, t, k, n)
        assert len(layout) == tp
        for r, held in enumerate(layout):
            shard = column_shard(weight, r, tp) if kind == "column" else row_shard(weight, r, tp)
            assert torch.equal(A[held.a], shard.T), (kind, r)
            assert held.partial == (kind == "row")
            # The X block a rank reads is the one its A block multiplies, and Y's
            # block is what their product fills.
            assert _extent(held.x[1], k) == _extent(held.a[0], k)
            assert _extent(held.y[1], n) == _extent(held.a[1], n)
        # Every element of the split dimension belongs to exactly one rank.
        split, size = (1, n) if kind == "column" else (0, k)
        owners = sorted(_extent(held.a[split], size) for held in layout)
        assert owners == [(r * size // tp, (r + 1) * size // tp) for r in range(tp)]


def test_split_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="kind must be one of"):
        split_layout("diagonal", 2, 4, 8, 8)
    with pytest.raises(ValueError, match=r"column split on tp=4 ranks needs n \(the columns of A\) = 6 "
                                         r"to divide by tp=4"):
        split_layout("column", 4, 4, 8, 6)
    with pytest.raises(ValueError, match=r"row split on tp=3 ranks needs k \(the rows of A\) = 8"):
        split_layout("row", 3, 4, 8, 6)
    with pytest.raises(ValueError, match="tp must be a positive int, got 0"):
        split_layout("row", 0, 4, 8, 8)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp", [2, 4])
def test_plot_matrix_split_draws_the_layout(kind, tp, no_pyplot_figures):
    t, k, n = 4, 8, 8
    fig = plot_matrix_split(kind, tp, t, k, n)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 3 * (tp + 1)  # the whole product, then one row per rank
    shapes = {"X": (t, k), "A": (k, n), "Y": (t, n)}
    drawn = _by_gid(fig)
    for r, held in enumerate(split_layout(kind, tp, t, k, n)):
        for m, sl in (("X", held.x), ("A", held.a), ("Y", held.y)):
            patch = drawn[f"rank {r}: {m}"]
            (r0, r1), (c0, c1) = _extent(sl[0], shapes[m][0]), _extent(sl[1], shapes[m][1])
            assert (patch.get_x(), patch.get_y(), patch.get_width(), patch.get_height()) == \
                   (c0, r0, c1 - c0, r1 - r0), (kind, r, m)
        # A partial sum is hatched; a final block is not.
        assert bool(drawn[f"rank {r}: Y"].get_hatch()) == (kind == "row")
        # The rank's colour is the same in the whole product and in its own row.
        assert drawn[f"whole: A_{r}"].get_facecolor() == drawn[f"rank {r}: A"].get_facecolor()
    whole = {g for g in drawn if g.startswith("whole: ")}
    if kind == "column":
        assert whole == {"whole: X"} | {f"whole: {m}_{r}" for m in "AY" for r in range(tp)}
    else:
        assert whole == {"whole: Y"} | {f"whole: {m}_{r}" for m in "XA" for r in range(tp)}
        assert drawn["whole: Y"].get_hatch()
    assert ("all-reduce" in fig.get_suptitle()) == (kind == "row")
    _render(fig)


def test_plot_activation_memory_bars_and_formula_ticks(no_pyplot_figures):
    tps = [1, 2, 4]
    unit = 4096
    measured = {"TP": [16 * unit, 10 * unit, 7 * unit], "TP+SP": [16 * unit, 9 * unit, 5.5 * unit]}
    predicted = {"TP": [16 * unit, 10 * unit, 7 * unit]}
    fig = plot_activation_memory(tps, measured, predicted, unit_bytes=unit)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    drawn = _by_gid(fig)
    for mode, values in measured.items():
        for tp, value in zip(tps, values):
            assert drawn[f"{mode} @ tp={tp}"].get_height() == pytest.approx(value / unit)
    for tp, value in zip(tps, predicted["TP"]):
        assert list(drawn[f"formula: TP @ tp={tp}"].get_ydata()) == pytest.approx([value / unit] * 2)
    assert not any(g.startswith("formula: TP+SP") for g in drawn)  # no formula given for it
    # Bars of one tp sit side by side, in the order of the modes.
    for tp in tps:
        assert drawn[f"TP @ tp={tp}"].get_x() < drawn[f"TP+SP @ tp={tp}"].get_x()
    assert "units of S" in fig.axes[0].get_ylabel()
    _render(fig)
    # Without a unit the axis counts bytes.
    fig = plot_activation_memory([2], {"TP": [1000]})
    assert _by_gid(fig)["TP @ tp=2"].get_height() == 1000
    assert fig.axes[0].get_ylabel() == "bytes per rank"


def test_plot_activation_memory_rejects_mismatched_input():
    with pytest.raises(ValueError, match=r"measured\['TP'\] has 2 values for 3 tp sizes \[1, 2, 4\]"):
        plot_activation_memory([1, 2, 4], {"TP": [1, 2]})
    with pytest.raises(ValueError, match=r"predicted\['SP'\] has no measured bars"):
        plot_activation_memory([1], {"TP": [1]}, {"SP": [1]})
    with pytest.raises(ValueError, match=r"predicted\['TP'\] has 1 values for 2 tp sizes"):
        plot_activation_memory([1, 2], {"TP": [1, 2]}, {"TP": [1]})
    with pytest.raises(ValueError, match="tps is empty"):
        plot_activation_memory([], {"TP": []})
    with pytest.raises(ValueError, match="measured is empty"):
        plot_activation_memory([1], {})
