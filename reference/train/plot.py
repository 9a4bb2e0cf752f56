"""`python -m reference.train plot LOG.jsonl`: the loss and throughput curves of a run."""
from __future__ import annotations

import json
from pathlib import Path

from reference.viz import CATEGORICAL, NotebookFigure

__all__ = ["read_log", "plot_log"]


def read_log(path) -> list[dict]:
    """The step records of a trainer's JSONL log (a line each)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no log file {path}")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not a JSON record ({err.msg})") from None
    if not records:
        raise ValueError(f"{path} holds no step records")
    return records


def plot_log(records: list[dict], title: str = "training run"):
    """Loss (left axis) and tokens per second (right axis) against the step."""
    steps = [r["step"] for r in records]
    fig = NotebookFigure(figsize=(7.5, 3.6))
    ax = fig.add_subplot()
    ax.plot(steps, [r["loss"] for r in records], "o-", ms=3, color=CATEGORICAL[0], label="loss")
    skipped = [r["step"] for r in records if r.get("skipped")]
    if skipped:
        ax.plot(skipped, [r["loss"] for r in records if r.get("skipped")], "x", color="red",
                label="skipped (fp16 overflow)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    right = ax.twinx()
    right.plot(steps, [r["tokens_per_s"] for r in records], "-", lw=1, color=CATEGORICAL[4],
               label="tokens / s")
    right.set_ylabel("tokens / s")
    right.set_ylim(0, max(r["tokens_per_s"] for r in records) * 1.3)
    lines = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + right.get_legend_handles_labels()[1]
    ax.legend(lines, labels, fontsize=8, frameon=False, loc="upper right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
