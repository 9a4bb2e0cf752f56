"""What a rank imports: the packages a training rank loads leave matplotlib out.

The pictures live in each package's `viz` module, imported on its own (or, for
`reference.pipeline_parallel`'s re-exported pictures, on first use), so that the ranks a
launch starts do not pay for loading matplotlib. A fresh interpreter shows it: the test's own
process has matplotlib loaded by other tests."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RANK_IMPORTS = ("import reference.parallel, reference.train.loop, reference.pipeline_parallel, "
                "reference.context_parallel, reference.expert_parallel, reference.zero")


def _loads_matplotlib(statement: str) -> bool:
    code = f"import sys; {statement}; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def test_a_rank_never_imports_matplotlib():
    assert not _loads_matplotlib(RANK_IMPORTS)


def test_the_pictures_are_still_exported():
    # the check can fail: asking for a picture does load matplotlib
    assert _loads_matplotlib("from reference.pipeline_parallel import plot_timeline")
