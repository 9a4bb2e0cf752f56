"""Notebook 06's appendix section "A.2 ZeRO-3 with a pipeline: gather once, or reshard between
micro-batches", run from the notebook's own cells.

One 4-rank launch (cell `fsdp-pp-launch`, dp 2 x pp 2, 1F1B over m = 4, the tiny GPT with 8
blocks) trains a step with `reshard_after_forward` False and True; the cell asserts its bytes,
calls and held peaks against the formulas it prints. This file checks the prose's claims again:

* bytes over dp a step: (N-1) x 4 S per transfer, 2 of them gathering once, 3 m resharding
  (2 m all-gathers, m reduce-scatters, one call per unit and micro-batch): 3 m / 2 = 6 times;
* parameters + gradients at the peak: 8 P gathering once; resharding 8 S (= 4 P at N = 2, no
  padding) + 8 P_block, + 4 P_root on the first stage only; less on both stages, the last more
  so; the same loss either way;
* one more launch: at m = 2 the bytes follow the same formula and the peaks are those of m = 4
  (flat in m); with 4 blocks (2 a stage) the first stage holds as much either way;
* the picture: the formulas for m = 1 .. 8 with the measured points at m = 4.
"""
import math

import pytest
from notebook_cells import NB06, run_cells
from notebook_cells import cells as nb_cells

SECTION = ["fsdp-pp-intro", "fsdp-pp-run", "fsdp-pp-step-md", "fsdp-pp-step", "fsdp-pp-formulas-md",
           "fsdp-pp-formulas", "fsdp-pp-launch-md", "fsdp-pp-launch", "fsdp-pp-print", "fsdp-pp-picture-md",
           "fsdp-pp-picture", "fsdp-pp-picture-held", "fsdp-pp-read"]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ns():
    # each cell asserts its own claims
    return run_cells(NB06, "setup", "fsdp-pp-run", "fsdp-pp-step", "fsdp-pp-formulas", "fsdp-pp-launch",
                     "fsdp-pp-print", "fsdp-pp-picture", "fsdp-pp-picture-held", name="nb06_fsdp_pp_cells")


@pytest.fixture(scope="module")
def more(ns):
    """m = 2 with the cell's model, and m = 4 with the notebook's 4-block GPT (2 blocks a stage)."""
    run, shallow = ns["fsdp_pp_run"], ns["CFG"]
    return ns["launch"](lambda: (run(2), run(4, shallow)), 4)


def test_the_section_ends_the_appendix_after_fsdp_tp_without_outputs():
    cells = nb_cells(NB06)
    ids = [c.get("id") for c in cells]
    start = ids.index(SECTION[0])
    assert ids[start - 1] == "fsdp-tp-reload" and ids[start:start + len(SECTION)] == SECTION
    assert start + len(SECTION) == len(cells)                      # the notebook's last section
    assert "".join(cells[start]["source"]).startswith(
        "### A.2 ZeRO-3 with a pipeline: gather once, or reshard between micro-batches")
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in cells[start:start + len(SECTION)] if c["cell_type"] == "code")
    prose = "".join(cells[start]["source"])
    assert "`fully_shard` defaults to `reshard_after_forward=None`" in prose
    assert "course defaults to False" in prose


def _check_bytes(runs, m):
    for out in runs:
        for reshard, o in out.items():
            t = (2 - 1) * 4 * o["S"]                              # N = 2
            if reshard:
                U = o["units"]
                assert U == 5                                     # 4 blocks and the root
                assert o["sent"] == {"all_gather": 2 * m * t, "reduce_scatter": m * t}
                assert o["calls"] == {"all_gather": 2 * m * U, "reduce_scatter": m * U}
            else:
                assert o["sent"] == {"all_gather": t, "reduce_scatter": t}
                assert o["calls"] == {"all_gather": 1, "reduce_scatter": 1}
        ratio = sum(out[True]["sent"].values()) / sum(out[False]["sent"].values())
        assert ratio == 3 * m / 2


def test_bytes_are_3m_transfers_against_2(ns):
    assert ns["M"] == 4 and ns["N"] == 2 and ns["DEEP"].n_layer == 8
    _check_bytes(ns["fsdp_pp"], 4)


def _peaks(out):
    once, resh = out[False], out[True]
    P, S, Pb, Pr = once["P"], once["S"], once["P_block"], once["P_root"]
    assert S * 2 == P and 8 * S == 4 * P                          # no padding: 8 S is half of 8 P
    assert P == Pr + 4 * Pb                                       # the root and 4 blocks
    assert once["held"] == 8 * P
    assert resh["held"] == 8 * S + 8 * Pb + (4 * Pr if resh["first"] else 0)
    return once["held"], resh["held"]


def test_resharding_holds_less_on_both_stages_the_last_more_so(ns):
    ratios = {}
    for out in ns["fsdp_pp"]:
        once, resh = _peaks(out)
        assert resh < once
        ratios.setdefault(out[True]["first"], set()).add(resh / once)
        assert out[True]["loss"] == out[False]["loss"]             # the same step either way
    (first,), (last,) = ratios[True], ratios[False]
    assert last < first < 1


def test_flat_in_m_and_a_tie_with_two_blocks_a_stage(ns, more):
    m2 = [r[0] for r in more]
    _check_bytes(m2, 2)
    by_rank = {r: {k: v["held"] for k, v in out.items()} for r, out in enumerate(ns["fsdp_pp"])}
    assert {r: {k: v["held"] for k, v in out.items()} for r, out in enumerate(m2)} == by_rank
    for out in (r[1] for r in more):                              # 2 blocks a stage, m = 4
        once, resh = out[False], out[True]
        assert once["P"] == once["P_root"] + 2 * once["P_block"]
        assert once["held"] == 8 * once["P"]
        if resh["first"]:
            assert resh["held"] == once["held"]                   # 4 P + 8 P_b + 4 P_r = 8 P
        else:
            assert resh["held"] < once["held"]


def test_the_picture_draws_the_formulas_and_the_measured_points(ns):
    fig = ns["fig_pp"]
    ax_bytes, ax_held = fig.axes
    lines = [ln for ln in ax_bytes.get_lines() if len(ln.get_xdata()) == 8]
    points = [ln for ln in ax_bytes.get_lines() if len(ln.get_xdata()) == 1]
    assert len(lines) == 2 and len(points) == 2
    first = ns["fsdp_pp"][ns["stages"][True]]
    for ln, reshard in zip(lines, (False, True)):
        S = first[reshard]["S"]
        want = [(3 * m if reshard else 2) * 4 * S / 1e6 for m in range(1, 9)]
        assert list(ln.get_xdata()) == list(range(1, 9))
        assert ln.get_ydata() == pytest.approx(want)
    for pt, reshard in zip(points, (False, True)):
        assert pt.get_xdata()[0] == 4
        assert pt.get_ydata()[0] == pytest.approx(sum(first[reshard]["sent"].values()) / 1e6)
    held_lines = [ln for ln in ax_held.get_lines() if len(ln.get_xdata()) == 8]
    assert len(held_lines) == 4 and all(len(set(ln.get_ydata())) == 1 for ln in held_lines)
    held_points = sorted(ln.get_ydata()[0] for ln in ax_held.get_lines() if len(ln.get_xdata()) == 1)
    want = sorted(out[k]["held"] / 1e3 for out in (first, ns["fsdp_pp"][ns["stages"][False]])
                  for k in (False, True))
    assert held_points == pytest.approx(want)
    assert math.isclose(ax_held.get_ylim()[0], 0)
