"""Every lecture notebook runs top to bottom, headless, within its time budget;
every committed notebook is stored without outputs."""
import json
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LECTURES = sorted((ROOT / "notebooks").glob("*.ipynb"))
COMMITTED = sorted(p for d in ("notebooks", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))

# Seconds of wall time a notebook may take on a 2-core CPU machine. Each aims at
# about a minute; the margin absorbs a loaded machine and the kernel's start-up.
DEFAULT_BUDGET = 240
BUDGETS: dict[str, int] = {}


def _budget(path: Path) -> int:
    return BUDGETS.get(path.name, DEFAULT_BUDGET)


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("path", LECTURES, ids=[p.name for p in LECTURES])
def test_notebook_runs_headless_within_budget(path, tmp_path):
    papermill = pytest.importorskip("papermill")
    budget = _budget(path)
    start = time.monotonic()
    # Runs in an empty working directory so a notebook cannot depend on files
    # lying around the repository; a failing cell raises PapermillExecutionError.
    papermill.execute_notebook(
        str(path), str(tmp_path / path.name), cwd=str(tmp_path), kernel_name="python3",
        execution_timeout=budget, progress_bar=False, log_output=False,
    )
    elapsed = time.monotonic() - start
    assert elapsed < budget, f"{path.name} took {elapsed:.0f} s, over its budget of {budget} s"


@pytest.mark.parametrize("path", COMMITTED, ids=[str(p.relative_to(ROOT)) for p in COMMITTED])
def test_committed_notebook_has_no_outputs(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    dirty = [
        i for i, cell in enumerate(nb["cells"])
        if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, (f"{path.relative_to(ROOT)} has outputs or execution counts in cells {dirty}: "
                       f"clear them before committing")
