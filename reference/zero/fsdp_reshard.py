"""Composed ZeRO-3, resharded between micro-batches (FSDP2's ``reshard_after_forward=True``).

`reference.zero.fsdp_param` keeps a stage whole through all m micro-batches (8 P bytes of
parameters and gradients in fp32). Here each pipeline chunk is cut into
`reference.zero.units.Unit`s over the same shards, as torchtitan applies `fully_shard`: one per
transformer `Block` and a root (embedding, final LayerNorm, head), and for every micro-batch

    F   the root is gathered for the action; each block is all-gathered by a forward
        pre-hook and freed by a forward hook as soon as its forward returns
    B   the root is gathered for the action; each block is all-gathered again when the
        gradient of its output arrives, or by activation checkpointing's recomputation;
        once every parameter of a unit has its gradient, the unit's whole gradients are
        reduce-scattered into its shards' gradient, summed over the micro-batches

so per step and chunk, over N = dp x cp ranks (4 N S the stage's fp32 bytes padded per tensor,
U the chunk's units):

    sent per step   all-gather  2 m (N-1)/N x 4 N S      reduce-scatter  m (N-1)/N x 4 N S
    calls           2 m U all-gathers                    m U reduce-scatters
    (gather once:   (N-1)/N x 4 N S in 1 call each way)

Between micro-batches a stage is its shards and their gradients (8 S bytes), and inside an
action about one block is whole beside the root. With N = 2, 8 S is already 4 P, so resharding
holds less only with more than a few blocks (the tests and notebook 06 measure it); with
activation checkpointing the executor recomputes a whole stage, so every block is whole from
the recomputation to its backward. Between steps `p.data` and `p.grad` are the shards, as with
gathering once, so the optimizer, the loss scaler and the clip see what they saw; the tied
embedding's two copies (the executor) and the sequence-parallel gradients over tp
(`reference.parallel.step`) are summed on the shards' gradients.

PyTorch's `fully_shard` defaults to True for every module but the root; this course defaults
to False (`ParallelConfig.reshard_after_forward`), as torchtitan under a pipeline. Every
backward reduce-scatters (as FSDP2 with sync on), so whole gradients never pile up; ranks
reduce units in the same order for a graph that does not depend on the data
(`ParallelConfig` refuses experts).
"""
from __future__ import annotations

import contextlib

from reference.model import Block
from reference.zero.units import Unit, on_output_grad

__all__ = ["ReshardAfterForward"]


class ReshardAfterForward:
    """``reshard_after_forward=True`` for the parameters of ``sharded`` (`ShardedParameters`),
    used by the pipeline chunks ``stages`` over ``microbatches`` micro-batches a step.

        reshard = ReshardAfterForward(pm.data_parallel.sharded, pm.stages, m)
        with reshard.step():                     # p.data: views of freed buffers, then shards again
            run_pipeline(..., action_hook=reshard.hook)

    ``units[c]``: chunk c's units, the root (parameters outside any `Block`) first."""

    def __init__(self, sharded, stages, microbatches: int):
        if not hasattr(sharded, "unit"):
            raise TypeError(f"reshard_after_forward needs one ShardedParameters over the dp x cp "
                            f"group, got {type(sharded).__name__}")
        self.stages, self.m = list(stages), microbatches
        self.units: list[list[Unit]] = []
        self.roots: list[Unit | None] = []  # each chunk's root unit: whole for every action
        self.blocks: list[tuple] = []       # (Block module, its unit): the forward hooks' places
        owner: dict[int, int] = {}
        for c, stage in enumerate(self.stages):
            blocks = [(name, mod) for name, mod in stage.named_modules()
                      if isinstance(mod, Block) and any(True for _ in mod.parameters())]
            in_block = {id(p) for _, mod in blocks for p in mod.parameters()}
            root = [p for p in stage.parameters() if id(p) not in in_block]
            chunk = [sharded.unit(f"chunk {c} root", root)] if root else []
            self.roots.append(chunk[0] if root else None)
            for name, mod in blocks:
                chunk.append(sharded.unit(f"chunk {c} {name}", list(mod.parameters())))
                self.blocks.append((mod, chunk[-1]))
            for unit in chunk:
                for p in unit.params:
                    if owner.setdefault(id(p), c) != c:
                        raise ValueError(f"a parameter of shape {tuple(p.shape)} is in chunks "
                                         f"{owner[id(p)]} and {c} of this rank: one unit each")
            self.units.append(chunk)
        self.unit_of = {id(p): u for chunk in self.units for u in chunk for p in u.params}
        self.phase: str | None = None   # "F" or "B" while an action runs
        self.backwards = [0] * len(self.stages)
        self._handles: list = []

    def held_tensors(self) -> list:
        """The shards and their accumulated gradients, kept beside the parameters during a step:
        `reference.memory.measure(params + held_tensors())` gives what this rank holds then."""
        return [t for chunk in self.units for u in chunk
                for t in list(u.shards or []) + ([u.grad] if u.grad is not None else [])]

    # ------------------------------------------------------------------ one step
    @contextlib.contextmanager
    def step(self):
        """Inside: every parameter a view of its unit's (freed) buffer and the hooks on.
        After (also on an error): every parameter its shard again."""
        for chunk in self.units:
            for u in chunk:
                for p, c_shape in zip(u.params, u.layout.c_shapes):
                    if p.shape != c_shape:
                        raise RuntimeError(f"{u.name}: a parameter holds {tuple(p.shape)}, not its "
                                           f"shard {tuple(c_shape)} (gathered already?)")
                    if p.grad is not None:
                        raise RuntimeError(f"{u.name}: zero the gradients before the step")
                u.to_whole(keep_shards=True)
        self.backwards = [0] * len(self.stages)
        self._install()
        try:
            yield self
        finally:
            for h in self._handles:
                h.remove()
            self._handles, self.phase = [], None
            unfinished = [u for chunk in self.units for u in chunk if u.shards is not None]
            for u in unfinished:  # only after an error: the step's gradients are dropped
                u.to_shards(with_grads=False)
        if unfinished:
            raise RuntimeError(f"the pipeline ran {self.backwards} backwards per chunk, expected "
                               f"{self.m} each: {len(unfinished)} units never finished")

    def _install(self) -> None:
        for mod, unit in self.blocks:
            self._handles.append(mod.register_forward_pre_hook(
                lambda module, args, unit=unit: unit.gather()))
            self._handles.append(mod.register_forward_hook(
                lambda module, args, out, unit=unit: self._after_block(unit, out)))
        for chunk in self.units:
            for u in chunk:
                for p in u.params:
                    if p.requires_grad:
                        self._handles.append(p.register_post_accumulate_grad_hook(self._arrived))

    def _after_block(self, unit: Unit, out) -> None:
        on_output_grad(out, unit.gather)  # its backward gathers it again
        if self.phase == "F":
            unit.free()  # (in B a recomputation's forward keeps it for the backward that follows)

    def _arrived(self, p) -> None:
        unit = self.unit_of[id(p)]
        if unit.grad_arrived(p) and self.phase == "B":
            unit.reduce_into_grad()
            unit.free()

    def hook(self, when: str, action) -> None:
        """The executor's per-action hook: ``when`` "before" or "after" ``action`` (F or B of
        ``action.chunk``)."""
        chunk, root = self.units[action.chunk], self.roots[action.chunk]
        if when == "before":
            self.phase = action.op
            if action.op == "B":
                for u in chunk:
                    u.expect_grads()
            if root is not None:
                root.gather()  # the embedding and the head: whole for the action
            return
        if action.op == "B":
            for u in reversed(chunk):  # what no gradient completed (unused parameters): last block first
                if not u.reduced:
                    u.reduce_into_grad()
                    u.free()
            self.backwards[action.chunk] += 1
        for u in chunk:
            u.free()
        self.phase = None
        if action.op == "B" and self.backwards[action.chunk] == self.m:
            for u in chunk:  # before the executor sums the tied embedding over its two copies
                u.to_shards(with_grads=True)
