"""Draws the pictures the README and the manuals show, with the course's own plotting code.

    python docs/pictures.py            # rewrites docs/img/*.png
    python docs/pictures.py OUT_DIR    # writes them elsewhere (tests/test_docs.py does)

The README's picture is the pipeline that notebook 04 builds: 1F1B and the zero-bubble
ZB-V schedule on 4 ranks and 8 micro-batches, one above the other, drawn by
`reference.pipeline_parallel.viz.plot_schedule` from the schedules as data.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from reference.pipeline_parallel import build_schedule  # noqa: E402
from reference.pipeline_parallel.viz import plot_schedule  # noqa: E402
from reference.viz import NotebookFigure  # noqa: E402

HERE = Path(__file__).resolve().parent
PICTURES = {"schedules.png": "1F1B and ZB-V on pp = 4, m = 8"}


def schedules(path: Path) -> None:
    """1F1B (F = 1, B = 2) and ZB-V (F = I = W = 1): the white space is the bubble."""
    fig = NotebookFigure(figsize=(11, 5.2))
    top, bottom = fig.subplots(2, 1, sharex=True)  # ZB-V's shorter step shows
    plot_schedule(build_schedule("1f1b", 4, 8), t_f=1, t_b=2, ax=top)
    longest = top.get_xlim()[1]
    plot_schedule(build_schedule("zb-v", 4, 8, 2), t_f=1, t_b=2, ax=bottom)
    bottom.set_xlim(0, max(longest, bottom.get_xlim()[1]))  # one time axis for both
    fig.savefig(path, dpi=90, metadata={"Software": None})


def main(out_dir: Path = HERE / "img") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    schedules(out_dir / "schedules.png")
    return [out_dir / name for name in PICTURES]


if __name__ == "__main__":
    for written in main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "img"):
        print(written)
