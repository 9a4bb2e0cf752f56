"""Cells of a lecture notebook, by id, for tests that check the claims a section makes.

    cells(NB06)                          # the notebook's cells, as stored (no outputs)
    source(NB06, "fsdp-tp-run")          # one cell's code
    run_cells(NB06, "setup", "my-train") # a namespace after running them in order (each asserts
                                         # its own claims), with optional given names first
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NB06 = ROOT / "notebooks" / "06_3d_parallel.ipynb"


def cells(notebook: Path) -> list[dict]:
    return json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]


def source(notebook: Path, cell_id: str) -> str:
    (cell,) = [c for c in cells(notebook) if c.get("id") == cell_id]
    return "".join(cell["source"])


def run_cells(notebook: Path, *cell_ids: str, name: str = "notebook_cells", **given) -> dict:
    ns = {"__name__": name, **given}
    tag = Path(notebook).name[:2]
    for cell_id in cell_ids:
        exec(compile(source(notebook, cell_id), f"{tag}:{cell_id}", "exec"), ns)
    return ns
