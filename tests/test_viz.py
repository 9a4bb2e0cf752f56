"""The pictures: right number of panels, and the values passed in drawn as text."""
import io

import pytest
import torch
from matplotlib.figure import Figure

from reference import viz
from reference.mesh import Mesh


def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def _render(fig):
    """Draw the figure to PNG bytes: layout and text placement must work headless."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def no_pyplot_figures():
    # The functions must not leave figures in pyplot's global list (they never call it).
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    yield
    assert plt.get_fignums() == before
    plt.close("all")


@pytest.mark.parametrize("mesh", [Mesh(pp=2, dp=2, tp=2), Mesh(dp=4, tp=2, ep=2), Mesh(), Mesh(pp=6, dp=1, tp=2)])
def test_plot_mesh_has_one_panel_per_stage_and_labels_every_rank(mesh, no_pyplot_figures):
    fig = viz.plot_mesh(mesh)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == mesh.pp
    texts = _texts(fig)
    for rank in range(mesh.world_size):
        c = mesh.coords(rank)
        label = next(t for t in texts if t.startswith(f"rank {rank}\n"))
        assert f"pp={c.pp} dp={c.dp} tp={c.tp}" in label
        assert (f"ep={c.ep} edp={c.edp}" in label) == (mesh.ep > 1)
    # Each stage's panel holds exactly that stage's ranks.
    for pp_rank, ax in enumerate(fig.axes):
        ranks = sorted(int(t.get_text().split("\n")[0].split()[1]) for t in ax.texts)
        assert ranks == [r for r in range(mesh.world_size) if mesh.coords(r).pp == pp_rank]
    assert str(mesh) in fig.get_suptitle()
    _render(fig)


def _all_to_all(before):
    world = len(before)
    return [torch.stack([before[src][dst] for src in range(world)]) for dst in range(world)]


COLLECTIVES = {
    # name: (before, after), written as the collective's definition, on 4 ranks.
    "broadcast from rank 0": ([torch.tensor([7.0, 8.0])] + [torch.zeros(2)] * 3, [torch.tensor([7.0, 8.0])] * 4),
    "all-reduce (sum)": ([torch.arange(4) + 10 * r for r in range(4)],
                         [sum(torch.arange(4) + 10 * r for r in range(4))] * 4),
    "reduce-scatter": ([torch.arange(4) + 10 * r for r in range(4)],
                       [torch.tensor([60 + 4 * r]) for r in range(4)]),
    "all-gather": ([[r + 0.5] for r in range(4)], [[0.5, 1.5, 2.5, 3.5]] * 4),
    "all-to-all": ([torch.arange(4) + 10 * r for r in range(4)],
                   _all_to_all([torch.arange(4) + 10 * r for r in range(4)])),
    "send/recv 0 -> 1": ([torch.tensor([1.25, 2.0]), torch.tensor([]), [], None],
                         [torch.tensor([1.25, 2.0]), torch.tensor([1.25, 2.0]), [], None]),
}


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_plot_collective_prints_every_value(name, no_pyplot_figures):
    before, after = COLLECTIVES[name]
    fig = viz.plot_collective(name, before, after)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 2
    assert fig.get_suptitle() == name
    ax_before, ax_after = fig.axes
    for ax, rows in ((ax_before, before), (ax_after, after)):
        cells = [t.get_text() for t in ax.texts if t.get_text() != "(empty)"]
        expected = [viz._fmt(v) for row in rows for v in viz._as_values(row)]
        assert cells == expected
        empty_rows = sum(1 for row in rows if len(viz._as_values(row)) == 0)
        assert sum(t.get_text() == "(empty)" for t in ax.texts) == empty_rows
    _render(fig)


def test_plot_collective_colours_equal_values_alike():
    before = [[1, 2], [3, 4]]
    after = [[1, 3], [2, 4]]  # a transpose: every value moves, none is new
    fig = viz.plot_collective("all-to-all", before, after)
    colour = {}
    for patch, text in zip(
        [p for ax in fig.axes for p in ax.patches], [t for ax in fig.axes for t in ax.texts]
    ):
        colour.setdefault(text.get_text(), set()).add(tuple(patch.get_facecolor()))
    assert all(len(c) == 1 for c in colour.values())          # one colour per value
    assert len({next(iter(c)) for c in colour.values()}) == 4  # distinct values, distinct colours


def test_plot_collective_formats_values():
    fig = viz.plot_collective("x", [torch.tensor([3.0, 0.1234567]), torch.tensor([2], dtype=torch.int64)],
                              [torch.tensor([1.0 / 3.0]), torch.tensor([True])])
    assert _texts(fig) == ["3", "0.123", "2", "0.333", "True"]


def test_plot_collective_rejects_mismatched_ranks():
    with pytest.raises(ValueError, match="before has 2 ranks but after has 3"):
        viz.plot_collective("x", [[1], [2]], [[1], [2], [3]])


def _ring_all_reduce_states(world):
    """Snapshots of a ring all-reduce of chunk values 10 * rank + chunk, one per step."""
    chunks = [[10 * r + c for c in range(world)] for r in range(world)]
    states = [("start", [list(row) for row in chunks])]
    for step in range(world - 1):  # reduce-scatter: rank r adds the chunk its left neighbour sends
        prev = [list(row) for row in chunks]
        for r in range(world):
            c = (r - step - 1) % world
            chunks[r][c] = prev[r][c] + prev[(r - 1) % world][c]
        states.append((f"reduce-scatter {step + 1}", [list(row) for row in chunks]))
    for step in range(world - 1):  # all-gather: rank r copies the finished chunk from the left
        prev = [list(row) for row in chunks]
        for r in range(world):
            c = (r - step) % world
            chunks[r][c] = prev[(r - 1) % world][c]
        states.append((f"all-gather {step + 1}", [list(row) for row in chunks]))
    return states


@pytest.mark.parametrize("world", [2, 4])
def test_plot_ring_steps_has_one_panel_per_snapshot(world, no_pyplot_figures):
    states = _ring_all_reduce_states(world)
    assert states[-1][1] == [[sum(10 * r + c for r in range(world)) for c in range(world)]] * world
    fig = viz.plot_ring_steps(states)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == len(states) == 2 * world - 1
    for ax, (label, per_rank) in zip(fig.axes, states):
        assert ax.get_title() == label
        assert [t.get_text() for t in ax.texts] == [str(v) for row in per_rank for v in row]
    _render(fig)


def test_plot_ring_steps_accepts_tensors_and_unknown_chunks():
    states = [("start", [[torch.tensor([1.0, 2.0]), None], [None, torch.tensor(3.0)]])]
    fig = viz.plot_ring_steps(states)
    assert _texts(fig) == ["1,2", "", "", "3"]
    with pytest.raises(ValueError, match="states is empty"):
        viz.plot_ring_steps([])
    with pytest.raises(ValueError, match=r"states\[0\] must be a \(label, chunks_per_rank\) pair"):
        viz.plot_ring_steps(["start"])


def test_plot_cost_model_curves_asymptotes_and_crossover(no_pyplot_figures):
    alpha, beta, world = 2e-5, 1e-9, 4
    sizes = [2 ** k for k in range(4, 27, 2)]
    measured = [3e-5 + 2 * 3 / 4 * n * beta for n in sizes]
    fig = viz.plot_cost_model(sizes, measured, alpha=alpha, beta=beta, world_size=world)
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    assert ax.get_xscale() == ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(labels) == 4
    assert labels[0].startswith("model T(n)")
    assert labels[1] == "latency-bound: 2(N-1)α = 120 µs"  # 2 * 3 * 20 µs
    assert labels[2].startswith("bandwidth-bound")
    assert labels[3] == "measured"
    model, latency, bandwidth, points = ax.get_lines()[:4]
    n = model.get_xdata()
    assert torch.allclose(torch.tensor(model.get_ydata()),
                          torch.tensor(6 * alpha + 1.5 * n * beta), rtol=1e-12, atol=0)
    assert set(latency.get_ydata()) == {6 * alpha}
    assert list(points.get_xdata()) == sizes and list(points.get_ydata()) == measured
    # n* = N alpha / beta = 80 000 bytes, where the two terms are equal.
    crossover = ax.get_lines()[4]
    assert list(crossover.get_xdata()) == [pytest.approx(80_000)] * 2
    assert "n* = Nα/β = 80 kB" in _texts(fig)
    assert "N=4" in ax.get_title() and "1 GB/s" in ax.get_title()
    _render(fig)


def test_plot_cost_model_without_measurements_and_bad_input():
    fig = viz.plot_cost_model([1e3, 1e6])
    assert len(fig.axes) == 1 and len(fig.axes[0].get_legend().get_texts()) == 3
    with pytest.raises(ValueError, match="world_size must be an int >= 2"):
        viz.plot_cost_model([1e3], world_size=1)
    with pytest.raises(ValueError, match="positive message sizes"):
        viz.plot_cost_model([0, 1e3])
    with pytest.raises(ValueError, match="measured_seconds has 1 values but sizes_bytes has 2"):
        viz.plot_cost_model([1e3, 1e6], [1e-3])



def test_figures_draw_themselves_in_a_notebook():
    # Jupyter calls _repr_png_ when a figure is a cell's last expression, pyplot or not.
    fig = viz.plot_collective("all-gather", [[1], [2]], [[1, 2], [1, 2]])
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
