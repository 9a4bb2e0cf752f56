"""The grader's outputs: results.json, a CSV table, and the table printed for the instructor.

Each submission is a dict:
    {"path", "homework", "total", "max", "note",
     "exercises": [{"id", "points", "max", "bonus", "cases_passed", "cases", "reason",
                    "failures"}]}
An exercise's `max` is its weight (points set by its difficulty) and `points` that weight
times the share of its cases passed; a `bonus` exercise counts in `total`, not in `max`.
`reason` is "" at full marks, else one line; `failures` has one line per failed case;
`note` says what happened to the notebook as a whole ("" when it ran to the end).
The CSV's first row under the header gives each exercise's weight ("+2" for a bonus).
"""
from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path

__all__ = ["write_json", "write_csv", "format_table", "exercise_columns"]


def _atomic_write(path: Path, text: str) -> None:
    """Replace `path` in one step: a reader sees the old file or the new one, and a link
    someone left at `path` is replaced, not followed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(results: list[dict], path: Path, **header) -> None:
    _atomic_write(path, json.dumps({**header, "submissions": results}, indent=1) + "\n")


def _num(value) -> str:
    """2 -> "2", 2.5 -> "2.5", 1.3333 -> "1.33"."""
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def exercise_columns(results: list[dict]) -> list[str]:
    """Exercise ids in order of first appearance (a batch may mix homework)."""
    ids: list[str] = []
    for r in results:
        ids += [e["id"] for e in r["exercises"] if e["id"] not in ids]
    return ids


def write_csv(results: list[dict], path: Path) -> None:
    ids = exercise_columns(results)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["path", "homework", *ids, "total", "max", "note"])
    weights: dict[str, str] = {}  # "4", or "+4" for a bonus
    for r in results:
        for e in r["exercises"]:
            weights.setdefault(e["id"], ("+" if e.get("bonus") else "") + _num(e["max"]))
    maxima = sorted({r["max"] for r in results if r["exercises"]})
    writer.writerow(["weight", "", *(weights.get(i, "") for i in ids), "",
                     _num(maxima[0]) if len(maxima) == 1 else "",
                     "points of each exercise by its difficulty; + marks a bonus"])
    for r in results:
        points = {e["id"]: _num(e["points"]) for e in r["exercises"]}
        writer.writerow([r["path"], r["homework"], *(points.get(i, "") for i in ids),
                         _num(r["total"]), _num(r["max"]), r["note"]])
    _atomic_write(path, out.getvalue())


def format_table(results: list[dict]) -> str:
    """Points per submission and exercise, of its weight; under each row, why points were
    lost. A bonus exercise's column says so."""
    ids = exercise_columns(results)
    bonus = {e["id"] for r in results for e in r["exercises"] if e.get("bonus")}
    ids_shown = [f"{i} (bonus)" if i in bonus else i for i in ids]
    names = [r["path"] for r in results]
    width = max([len("submission")] + [len(n) for n in names])
    cols = [max(len(i), 7) for i in ids_shown]
    lines = ["  ".join(["submission".ljust(width)] + [i.rjust(c) for i, c in zip(ids_shown, cols)]
                       + ["  total"])]
    lines.append("-" * len(lines[0]))
    for r, name in zip(results, names):
        by_id = {e["id"]: e for e in r["exercises"]}
        cells = [(f"{_num(by_id[i]['points'])}/{_num(by_id[i]['max'])}" if i in by_id
                  else "-").rjust(c) for i, c in zip(ids, cols)]
        lines.append("  ".join([name.ljust(width)] + cells
                               + [f"{_num(r['total'])}/{_num(r['max'])}".rjust(7)]))
        if r["note"]:
            lines.append(f"    note: {r['note']}")
        for e in r["exercises"]:
            if e["reason"]:
                lost = _num(round(e["max"] - e["points"], 2))
                lines.append(f"    {e['id']}: -{lost}: {e['reason']}")
    return "\n".join(lines)
