"""The committed golden losses of the debug run: recomputed by one process, reproduced by 8.

Regenerate with `python -m reference.parallel.golden --write` after a change that is meant
to move the numbers (say so in the commit). Tolerance rtol 1e-4: the same torch build on
another CPU may sum in another order (vector width), ~1e-7 relative per operation, which
20 AdamW steps grow to ~1e-6-1e-5; a real change (init, data, learning rate, a wrong
gradient) moves the losses by far more than 1e-4.
"""
import pytest

from reference.parallel import golden
from reference.runtime import launch


def _close(got, want, rtol=1e-4):
    assert len(got) == len(want) == golden.STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert worst <= rtol, f"losses moved by {worst:.2e} (relative): {got} vs {want}"


def test_single_process_reproduces_the_golden_file():
    _close(golden.single_process_losses(), golden.read_golden())


def test_the_loss_really_falls():
    losses = golden.read_golden()
    assert losses[-1] < 0.6 * losses[0]  # the arithmetic text is learnable in 20 steps


@pytest.mark.timeout(600)
def test_the_debug_3d_run_on_8_ranks_reproduces_the_golden_file():
    ranks = launch(golden.parallel_losses, golden.CONFIG.world_size, timeout=400)
    for losses in ranks:
        assert losses == ranks[0]  # every rank reports the same global mean
    _close(ranks[0], golden.read_golden())
