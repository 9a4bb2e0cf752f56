"""The publish of a checkpoint needs every rank's agreement (`reference.train.checkpoint_publish`):
ranks that pass different steps, or a rank whose write fails, publish nothing, and every rank
raises the same clear error instead of waiting at a barrier."""
from __future__ import annotations

import pytest
import torch

from reference.model import GPT, GPTConfig
from reference.parallel import ParallelConfig
from reference.runtime import launch

pytestmark = pytest.mark.timeout(120)

CFG = GPTConfig.tiny(n_layer=2, block_size=16)


def _build():
    from reference.parallel import parallelize

    torch.manual_seed(0)
    config = ParallelConfig(dp=2)
    pm = parallelize(GPT(CFG), config.mesh().build_groups(), config)
    return pm, pm.make_optimizer(torch.optim.AdamW, lr=1e-3)


def _save(root, how):
    """Save step 1, then step 2 the way ``how`` says; return (the error or None, latest)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from reference.train.checkpoint import (CheckpointNotPublishedError, latest_checkpoint,
                                            save_checkpoint)

    pm, opt = _build()
    rank = dist.get_rank()
    save_checkpoint(root, 1, pm, opt)
    step = 2
    if how == "steps":
        step = 2 + rank  # rank 0 saves step 2, rank 1 step 3
    elif how == "dcp" and rank == 1:  # this rank's data files cannot be written
        def broken(self, plan, planner):
            raise OSError("No space left on device (injected)")
        dcp.FileSystemWriter.write_data = broken
    elif how == "after" and rank == 1:  # DCP's collectives finish; then this rank fails
        real = dcp.save

        def save_then_fail(*args, **kwargs):
            real(*args, **kwargs)
            raise OSError("fsync failed (injected)")
        dcp.save = save_then_fail
    try:
        save_checkpoint(root, step, pm, opt)
        error = None
    except CheckpointNotPublishedError as err:
        error = str(err)
    return error, latest_checkpoint(root).name, sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("how", ["steps", "dcp", "after"])
def test_disagreeing_ranks_publish_nothing(tmp_path, how):
    """Different steps (2 on rank 0, 3 on rank 1), a write that fails inside DCP on rank 1, or
    a failure on rank 1 after DCP's collectives: every rank raises one error naming the ranks
    and their steps or errors; no step_2 or step_3, no partial folder left, and
    latest_checkpoint is still step 1."""
    results = launch(_save, 2, tmp_path, how, timeout=90)
    errors = {r[0] for r in results}
    assert len(errors) == 1 and None not in errors, errors  # the same error on every rank
    error = errors.pop()
    assert error.startswith("checkpoint not published")
    if how == "steps":
        assert "different steps: step 2 on rank 0; step 3 on rank 1" in error
    elif how == "dcp":
        assert "rank 1: OSError: No space left on device (injected)" in error
    else:
        assert "rank 1 (step 2): OSError: fsync failed (injected)" in error
    for _, latest, names in results:
        assert latest == "step_000001"
        assert names == ["step_000001"], names  # nothing published, the partial folder cleared
