"""The process groups of each layout, built once per launch and shared by the cases run in it.

A test that runs many configurations in one launch (the all-pairs sweep, the checkpoint
matrix) would otherwise build a mesh's groups for every case: `dist.new_group` never frees
what it builds while the launch lives, and with a few hundred gloo groups alive every
collective of the later cases slows down (a 4-rank case took four times as long at the end
of the sweep's launch as at its start). Every rank runs the same cases in the same order, so
each builds or reuses the same groups: `new_group` is still called by all ranks alike.
"""
from __future__ import annotations

_BUILT: dict = {}


def built_mesh(config):
    """``config.mesh()`` with its process groups, those of an earlier case of the same degrees
    when there was one in this launch."""
    import torch.distributed as dist

    mesh = config.mesh()
    key = (id(dist.group.WORLD), mesh.dp, mesh.tp, mesh.pp, mesh.ep, mesh.cp, mesh.dp_replicate)
    if key not in _BUILT:
        _BUILT[key] = mesh.build_groups()
    return _BUILT[key]
