"""The committed golden losses of the debug run: recomputed by one process, reproduced by 8.

Regenerate with `python -m reference.train.golden --write` after a change that is meant
to move the numbers (say so in the commit). Tolerance: the course's loss tolerance,
`reference.tolerance.loss()` (rtol 1e-5): the same torch build on another CPU, or another
kernel set, sums in another order, and the 8 ranks sum in another order than one process;
a real change (init, data, learning rate, a wrong gradient) moves the losses by far more.
"""
import pytest

from reference.parallel import golden
from reference.train.golden import read_golden, single_process_losses
from reference.runtime import launch
from reference.tolerance import loss


def _close(got, want):
    assert len(got) == len(want) == golden.STEPS
    loss().assert_losses(got, want, "the debug run's losses against the golden file")


def test_single_process_reproduces_the_golden_file():
    _close(single_process_losses(), read_golden())


def test_the_loss_really_falls():
    losses = read_golden()
    assert losses[-1] < 0.6 * losses[0]  # the arithmetic text is learnable in 20 steps


@pytest.mark.timeout(600)
def test_the_debug_3d_run_on_8_ranks_reproduces_the_golden_file():
    ranks = launch(golden.parallel_losses, golden.CONFIG.world_size, timeout=400)
    for losses in ranks:
        assert losses == ranks[0]  # every rank reports the same global mean
    _close(ranks[0], read_golden())
