"""Global gradient-norm clipping: one norm over every shard of the model, counted once.

    norm = clip_grad_norm_(stages, max_norm=1.0, mesh=mesh)   # after the gradients are synchronised

``torch.nn.utils.clip_grad_norm_`` computes ||g|| over the tensors it is given. On one
rank of a parallel run those are not the model's gradients: a tensor-parallel rank holds
a slice of each split weight, a pipeline rank the layers of its stage, a ZeRO rank a
shard of the flat gradient, and data-parallel replicas hold the same numbers N times.
Clipping each rank by its own norm scales each piece by a different factor, which is a
different update from one process's. The global norm is

    ||g||^2 = sum over every number of the model, each counted exactly once, of g_i^2

and every rank scales its gradients by the same min(1, max_norm / (||g|| + 1e-6)),
as torch's function does. The rule that counts each number once (Megatron-LM's, in
`clip_grad_norm_fp32`, extended to data-parallel shards and experts):

* every rank sums g^2 over the tensors it *counts*, and one all-reduce of that scalar
  over the whole world adds the ranks' sums: the pieces held by different ranks are
  different numbers, so a sum adds each once;
* a tensor **split by tensor parallelism** (column- and row-parallel weights, column
  biases, the vocab-parallel embedding and head: ``p.tensor_model_parallel``) is
  counted on every tp rank, each holding its own slice; a tensor **replicated over tp**
  (LayerNorms, row-parallel biases, routers, experts) only on tp rank 0. Under sequence
  parallelism the LayerNorm and row-bias gradients are partial sums until
  `allreduce_sequence_parallel_grads` has run: call it first, then they are replicated;
* the **tied embedding** of a pipeline lives on the first and last stage, its gradient
  summed over both (`sync_tied_grads`): the last stage's copy is marked ``p.shared``
  and not counted, the first stage's is;
* **data parallelism**: after DDP's all-reduce every dp rank holds the same gradient, so
  only dp rank 0 counts it (``expert_parallel`` tensors: only expert-data-parallel rank
  0, since the experts differ across the ep ranks); context parallelism replicates too
  (its gradients averaged over dp x cp), so only cp rank 0 counts. ZeRO-1/2 and FSDP
  (ZeRO-3) hold after their reduce-scatter a *different* shard on every dp (x cp) rank
  (``p.data_parallel_shard``): every rank counts its own, each slice of the flat shard
  with the marks of the parameter it belongs to (the padding is zero and adds nothing).
  ZeRO-3 per parameter (`reference.zero.fsdp_param`) shards each tensor along dim 0:
  every dp (x cp) rank counts its rows, with the tensor's own tp and tied marks (a
  row-block of a replicated LayerNorm gain on tp rank 0 only, of a column-parallel
  weight on every tp rank).

Where the marks come from: `mark_parallel_params(modules)` reads them off the parameters
and modules (the cut a tensor-parallel layer recorded on each parameter it split,
``p.tp_cut``; the experts of MoE layers; a head stage whose embedding lives on another
pipeline rank)
and sets all four attributes on every parameter. `clip_grad_norm_` marks by itself
what it is given as modules (a model, DDP, or this rank's list of pipeline chunks),
a `ZeroOptimizer` or an `FSDP` module (after backward). Bare tensors are taken as they
are marked; with more than one rank an unmarked tensor is an error, since nothing
says whether it is a slice, a copy or a shard.

ZeRO-1/2: the clip acts on the reduced shard, so call ``optimizer.reduce_gradients()``
first. Stage 2 reduces during backward and `step()` does not reduce again, so
``reduce_gradients(); clip_grad_norm_(optimizer, ...); step()`` trains. Stage 1's
`step()` reduce-scatters its full gradient buffer itself, and a second reduce-scatter
after the clip would average the clipped shard with the other ranks' unreduced
numbers: with stage 1 the clip needs a step that skips the reduction already done.

Communication: one all-reduce of one number over the world, whatever the mesh. With
one process (no mesh, or a mesh of one rank) it reduces as torch does: for fp32
gradients the norm and the clipped gradients are torch's, bit for bit.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comms
from reference.expert_parallel import expert_parameters
from reference.pipeline_parallel import GPTStage
from reference.runtime import device as rank_device
from reference.zero import FSDP, ZeroOptimizer

__all__ = ["clip_grad_norm_", "mark_parallel_params", "MARKS"]

# The attributes `mark_parallel_params` sets on every parameter (Megatron's names for the first two).
MARKS = ("tensor_model_parallel", "shared", "expert_parallel", "data_parallel_shard")


def _as_modules(modules) -> list[nn.Module]:
    return [modules] if isinstance(modules, nn.Module) else list(modules)


def _unique_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    seen, out = set(), []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def mark_parallel_params(modules) -> list[nn.Parameter]:
    """Set the four `MARKS` on every parameter of `modules` (a module, or this rank's
    pipeline chunks); returns those parameters, each once. An `FSDP` module's shards
    are marked as data-parallel shards."""
    modules = _as_modules(modules)
    subs = [s for m in modules for s in m.modules()]
    split = {id(p) for s in subs for p in s.parameters(recurse=False)
             if hasattr(p, "tp_cut")}  # cut by its tensor-parallel layer (a row bias stays whole)
    experts = {id(p) for m in modules for p in expert_parameters(m)}
    stages = [s for s in subs if isinstance(s, GPTStage)]
    embedding_here = any(s.spec.embedding for s in stages)
    shared = {id(s.lm_head.weight) for s in stages if s.tied and s.spec.head and not embedding_here}
    for f in (s for s in subs if isinstance(s, FSDP)):
        inner = mark_parallel_params(f.module)
        if any(p.tensor_model_parallel or p.shared or p.expert_parallel for p in inner):
            raise ValueError("an FSDP module holding tensor-parallel, expert or tied pipeline "
                             "parameters: its flat shards mix them; pass the FSDP module itself "
                             "to clip_grad_norm_, which slices each shard by parameter")
        for unit in f.units:
            _set_marks(unit.shard, False, False, False, True)
    params = _unique_params(modules)
    shard_ids = {id(u.shard) for f in subs if isinstance(f, FSDP) for u in f.units}
    for p in params:
        if id(p) not in shard_ids:
            # ZeRO-3 per parameter (`ShardedParameters`): p holds its dim-0 rows of the
            # (TP-local) tensor, different numbers on every dp x cp rank
            _set_marks(p, id(p) in split, id(p) in shared, id(p) in experts,
                       hasattr(p, "zero_rows"))
    return params


def _set_marks(p, tensor_model_parallel, shared, expert_parallel, data_parallel_shard):
    p.tensor_model_parallel, p.shared = tensor_model_parallel, shared
    p.expert_parallel, p.data_parallel_shard = expert_parallel, data_parallel_shard


def flat_shard_pieces(layout, params, rank, shard_grad):
    """(parameter, slice of the shard gradient (S,) holding that parameter's numbers)."""
    start, end = layout.shard_range(rank)
    out = []
    for p, offset, numel in zip(params, layout.offsets, layout.numels):
        lo, hi = max(offset, start), min(offset + numel, end)
        if lo < hi:
            out.append((p, shard_grad[lo - start: hi - start]))
    return out


def _collect(params):
    """(pieces, targets): pieces (marks source, gradient, is a dp shard) to take the norm of,
    and the gradient tensors to scale."""
    if isinstance(params, ZeroOptimizer):
        if params.shard.grad is None:
            raise ValueError("the ZeroOptimizer holds no reduced gradient: call its "
                             "reduce_gradients() after backward, then clip, then step")
        pieces = flat_shard_pieces(params.layout, params.params, params.dp_rank, params.shard.grad)
        return [(p, g, True) for p, g in pieces], [params.shard.grad]
    if isinstance(params, torch.Tensor):
        params = [params]
    items = [params] if isinstance(params, nn.Module) else list(params)
    if items and all(isinstance(m, nn.Module) for m in items):
        modules = items
        fsdps = [m for m in modules if isinstance(m, FSDP)]
        pieces, targets = [], []
        for f in fsdps:
            mark_parallel_params(f.module)
            for unit in f.units:
                if unit.shard.grad is not None:
                    flat = flat_shard_pieces(unit.layout, unit.params, unit.dp_rank, unit.shard.grad)
                    pieces += [(p, g, True) for p, g in flat]
                    targets.append(unit.shard.grad)
        rest = [m for m in modules if not isinstance(m, FSDP)]
        items = mark_parallel_params(rest) if rest else []
        grads = [p for p in items if p.grad is not None]
        return (pieces + [(p, p.grad, p.data_parallel_shard) for p in grads],
                targets + [p.grad for p in grads])
    seen, unique = set(), []
    for p in items:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"clip_grad_norm_ takes tensors, modules, a ZeroOptimizer or an FSDP "
                            f"module, got {type(p).__name__}")
        if id(p) not in seen and p.grad is not None:
            seen.add(id(p))
            unique.append(p)
    return ([(p, p.grad, getattr(p, "data_parallel_shard", False)) for p in unique],
            [p.grad for p in unique])


def _counted(p, coords, mesh, dp_shard: bool) -> bool:
    """Whether this rank counts its piece of `p` (the rule of the module docstring)."""
    if not hasattr(p, "tensor_model_parallel"):
        if dp_shard and mesh.tp == mesh.pp == mesh.ep == 1:
            return True  # a ZeRO / FSDP shard with nothing else split: nothing to ask
        raise ValueError(
            f"a gradient of shape {tuple(p.shape)} carries no parallel marks, and with "
            f"{mesh} it could be a tensor-parallel slice, a replica or a shard: pass the "
            f"modules (clip_grad_norm_(stages, ...)), a ZeroOptimizer or an FSDP module, "
            f"or call mark_parallel_params(modules) first")
    if p.shared:
        return False  # the other end of the pipeline counts the tied weight
    if not p.tensor_model_parallel and coords.tp != 0:
        return False  # replicated over tp: tp rank 0 counts it
    if dp_shard:  # ZeRO / FSDP: every dp rank holds different numbers (HSDP: each block the same)
        return getattr(getattr(p, "zero_rows", None), "replica", 0) == 0
    return (coords.edp if p.expert_parallel else coords.dp) == 0 and coords.cp == 0


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, mesh=None, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient so the global norm is at most `max_norm`; returns the norm before.

    `params`: this rank's gradients, as modules (a model, DDP, its pipeline chunks),
    a `ZeroOptimizer` after ``reduce_gradients()``, an `FSDP` module after backward, or
    marked tensors. `mesh`: the run's `reference.mesh.Mesh` (None: one process).
    `norm_type`: 2 or inf. Every rank must call it (one all-reduce over the world).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type must be 2 or inf, got {norm_type!r}")
    pieces, targets = _collect(params)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    size = 1 if mesh is None else mesh.world_size
    if size != world:
        raise ValueError(f"clip_grad_norm_ needs the run's mesh: got mesh={mesh} (world_size={size}) "
                         f"but world_size={world} processes run")
    if world > 1:
        coords = mesh.coords(dist.get_rank())
        pieces = [(p, g, s) for p, g, s in pieces if _counted(p, coords, mesh, s)]
        device = rank_device()  # what the backend communicates: the GPU under NCCL
    else:
        device = targets[0].device if targets else torch.device("cpu")
    # One number per counted piece, in fp32 whatever the gradients' dtype.
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device) for _, g, _ in pieces]
    if world == 1:  # torch's own reduction of the per-tensor norms
        total = (torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms
                 else torch.zeros((), device=device))
    else:
        local = torch.zeros(1, device=device)  # this rank's sum of squares (or max)
        if norms:
            local[0] = torch.stack(norms).square().sum() if norm_type == 2.0 else torch.stack(norms).max()
        op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
        comms.all_reduce(local, op=op)  # every rank's: the whole model's
        total = local[0].sqrt() if norm_type == 2.0 else local[0]
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's formula, 1e-6 included
    for g in targets:
        g.mul_(clip_coef.to(device=g.device, dtype=g.dtype))
    return total
