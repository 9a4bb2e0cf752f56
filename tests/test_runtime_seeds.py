"""Every rank's random state: its own in every launch, reproducible with `launch(..., seed=)`.

Ranks are forked from one fork server, so without reseeding they would all inherit the
server's generator states: the same `torch.rand` on every rank and in every launch.
"""
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.distributed as dist

from reference import runtime
from reference.runtime import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _draw():
    """Four numbers from each default generator a rank may use, and torch's seed."""
    return {"torch": torch.rand(4), "random": [random.random() for _ in range(4)],
            "numpy": np.random.rand(4).tolist(), "initial_seed": torch.initial_seed(),
            "rank": dist.get_rank()}


def _differ(a, b):
    """True when two draws share no generator's numbers (each compared on its own)."""
    return (not torch.equal(a["torch"], b["torch"]) and a["random"] != b["random"]
            and a["numpy"] != b["numpy"])


def test_ranks_of_one_launch_draw_different_numbers():
    r0, r1 = launch(_draw, 2, quiet=True)
    assert _differ(r0, r1), (r0, r1)


def test_launches_without_seed_differ():
    first, second = launch(_draw, 2, quiet=True), launch(_draw, 2, quiet=True)
    for rank in range(2):
        assert _differ(first[rank], second[rank]), rank


def test_the_same_seed_gives_the_same_numbers_per_rank():
    first, second = launch(_draw, 2, seed=1234, quiet=True), launch(_draw, 2, seed=1234, quiet=True)
    other = launch(_draw, 2, seed=1235, quiet=True)
    for rank in range(2):
        a, b = first[rank], second[rank]
        # Exact: the same seed replays the same stream, bit for bit.
        assert torch.equal(a["torch"], b["torch"]) and a["random"] == b["random"]
        assert a["numpy"] == b["numpy"]
        assert _differ(a, other[rank]), "another seed, other numbers"
    assert _differ(first[0], first[1]), "rank r is seeded from (seed, r): ranks differ"


def test_the_seed_derivation_is_the_documented_one():
    results = launch(_draw, 2, seed=7, quiet=True)
    for rank, got in enumerate(results):
        value = runtime.rank_seed(7, rank)
        assert got["initial_seed"] == value
        torch.testing.assert_close(got["torch"], torch.rand(4, generator=torch.Generator().manual_seed(value)),
                                   rtol=0, atol=0)  # the same generator, so bit-identical
        python = random.Random(value)
        assert got["random"] == [python.random() for _ in range(4)]
    assert runtime.rank_seed(7, 0) != runtime.rank_seed(7, 1) != runtime.rank_seed(8, 1)
    assert 0 <= runtime.rank_seed(2**70, 3) < 2**63  # fits torch.manual_seed


@pytest.mark.parametrize("bad", [-1, 1.5, "0", True])
def test_a_bad_seed_is_refused(bad):
    with pytest.raises(ValueError, match=f"seed must be None or a non-negative int, got {bad!r}"):
        launch(print, 2, seed=bad)


TORCHRUN_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    from reference.runtime import launch

    if __name__ == "__main__":
        torch.manual_seed(0)  # what a script may have done before: the seed overrides it
        results = launch(lambda: torch.rand(3), 2, seed=int(sys.argv[2]))
        torch.save(results, os.path.join(sys.argv[1], f"rank{dist.get_rank()}.pt"))
""")


def test_torchrun_honours_the_seed(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(script), str(tmp_path), "11"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    # The same seed gives torchrun's ranks the numbers launch's own ranks draw.
    expected = launch(lambda: torch.rand(3), 2, seed=11, quiet=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for r in range(2):
            torch.testing.assert_close(got[r], expected[r], rtol=0, atol=0)  # same stream: exact
