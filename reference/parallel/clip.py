"""Global gradient-norm clipping: one norm over every shard of the model, counted once.

    norm = clip_grad_norm_(stages, max_norm=1.0, mesh=mesh)   # after the gradients are synchronised

On one rank of a parallel run the gradients are not the model's: a tensor-parallel rank holds
a slice of each split weight, a pipeline rank its stage's layers, a ZeRO rank a shard, and
data-parallel replicas the same numbers N times. Clipping each rank by its own norm scales each
piece by a different factor, a different update from one process's. The global norm is

    ||g||^2 = sum over every number of the model, each counted exactly once, of g_i^2

and every rank scales its gradients by the same min(1, max_norm / (||g|| + 1e-6)), as torch's
function does. Every rank sums g^2 over the tensors it *counts*, and one all-reduce of that
scalar over the world adds the ranks' sums. What a rank counts (Megatron-LM's rule, in
`clip_grad_norm_fp32`, extended to data-parallel shards and experts; `_counted`):

* a tensor **split by tensor parallelism** (``p.tensor_model_parallel``: column- and
  row-parallel weights, column biases, the vocab-parallel embedding and head) on every tp
  rank; a tensor **replicated over tp** (LayerNorms, row-parallel biases, routers, experts)
  on tp rank 0 only. Under sequence parallelism the LayerNorm and row-bias gradients are
  partial sums until `allreduce_sequence_parallel_grads` has run: call it first;
* the **tied embedding** of a pipeline, on the first and last stage with its gradient summed
  over both: the last stage's copy is marked ``p.shared`` and not counted; so is, under
  DualPipe, every weight of the second half's ranks (a stage marked ``counted_elsewhere``),
  whose copy on rank pp - 1 - r holds the same summed gradient;
* **data and context parallelism**: replicas hold the same gradient, so only dp rank 0 (an
  ``expert_parallel`` tensor: expert-data-parallel rank 0) and cp rank 0 count it. ZeRO-1/2
  and FSDP shards (``p.data_parallel_shard``) differ on every rank: each counts its own, each
  slice of a flat shard with the marks of its parameter; ZeRO-3 per parameter
  (`reference.zero.fsdp_param`) counts its dim-0 rows with the tensor's own marks.

`mark_parallel_params(modules)` sets the four marks on every parameter from what the modules
recorded (``p.tp_cut``, the experts of MoE layers, a head stage whose embedding lives on
another pipeline rank). `clip_grad_norm_` marks by itself what it is given as modules; a bare
tensor is taken as it is marked, and with more than one rank an unmarked one is an error
(nothing says whether it is a slice, a copy or a shard).

A flat shard (ZeRO-1/2's `ZeroOptimizer`, FSDP's units) mixes slices of many parameters: its
holder cuts it into pieces, each with the parameter whose marks count it (`flat_grad_pieces`),
and hands them to `clip_pieces`, the norm and the scaling both functions share. The
data-parallel way of a composed run does that (`reference.parallel.data_parallelism`: its
`clip`). ZeRO-1/2: the clip acts on the reduced shard, so ``optimizer.reduce_gradients()``
comes first; `step()` then does not reduce again.

Communication: one all-reduce of one number over the world. With one process the norm and the
clipped fp32 gradients are torch's, bit for bit."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comms
from reference.expert_parallel import expert_parameters
from reference.pipeline_parallel import GPTStage
from reference.runtime import device as rank_device

__all__ = ["clip_grad_norm_", "clip_pieces", "grad_pieces", "flat_grad_pieces", "mark_parallel_params", "MARKS",
           "local_norm", "global_norm", "scale_gradients", "clipped"]

# The attributes `mark_parallel_params` sets on every parameter (Megatron's names for the first two).
MARKS = ("tensor_model_parallel", "shared", "expert_parallel", "data_parallel_shard")


def mark_parallel_params(modules) -> list[nn.Parameter]:
    """Set the four `MARKS` on every parameter of `modules` (a module, or this rank's pipeline
    chunks); returns them, each once."""
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    subs = [s for m in modules for s in m.modules()]
    split = {id(p) for s in subs for p in s.parameters(recurse=False)
             if hasattr(p, "tp_cut")}  # cut by its tensor-parallel layer (a row bias stays whole)
    experts = {id(p) for m in modules for p in expert_parameters(m)}
    stages = [s for s in subs if isinstance(s, GPTStage)]
    embedding_here = any(s.spec.embedding for s in stages)
    shared = {id(s.lm_head.weight) for s in stages if s.tied and s.spec.head and not embedding_here}
    shared |= {id(p) for s in stages if getattr(s, "counted_elsewhere", False) for p in s.parameters()}
    params = list({id(p): p for m in modules for p in m.parameters()}.values())  # each once
    for p in params:
        p.tensor_model_parallel, p.shared = id(p) in split, id(p) in shared
        # ZeRO-3 per parameter (`ShardedParameters`): p holds its dim-0 rows of the
        # (TP-local) tensor, different numbers on every dp x cp rank
        p.expert_parallel, p.data_parallel_shard = id(p) in experts, hasattr(p, "zero_rows")
    return params


def flat_grad_pieces(layout, params, rank, shard_grad) -> list:
    """A flat shard's gradient (S,) cut into the norm's pieces: (the parameter whose marks count
    it, the slice of ``shard_grad`` holding that parameter's numbers, True: a data-parallel shard).
    Mark the parameters first (`mark_parallel_params`)."""
    if shard_grad is None:
        raise ValueError("the flat shard holds no reduced gradient: reduce it after the backward "
                         "(ZeroOptimizer.reduce_gradients()), then clip, then step")
    start, end = layout.shard_range(rank)
    out = []
    for p, offset, numel in zip(params, layout.offsets, layout.numels):
        lo, hi = max(offset, start), min(offset + numel, end)
        if lo < hi:  # the part of p inside this rank's shard [start, end)
            out.append((p, shard_grad[lo - start: hi - start], True))
    return out


def grad_pieces(params) -> tuple:
    """(pieces (marks source, gradient, is a dp shard) to take the norm of, gradients to scale)
    of modules (marked here) or of marked tensors: what `clip_pieces` and `local_norm` take."""
    if isinstance(params, torch.Tensor):
        params = [params]
    items = [params] if isinstance(params, nn.Module) else list(params)
    if items and all(isinstance(m, nn.Module) for m in items):
        items = mark_parallel_params(items)
    seen, unique = set(), []
    for p in items:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"clip_grad_norm_ takes tensors or modules, got {type(p).__name__} (a flat "
                            f"shard's pieces go to clip_pieces, `flat_grad_pieces`)")
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
            f"modules (clip_grad_norm_(stages, ...)), or call mark_parallel_params(modules) first")
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

    `params`: this rank's gradients, as modules (a model, DDP, its pipeline chunks) or marked
    tensors; `mesh`: the run's `reference.mesh.Mesh` (None: one process); `norm_type`: 2 or inf."""
    return clip_pieces(*grad_pieces(params), max_norm, mesh, norm_type)


@torch.no_grad()
def clip_pieces(pieces: list, targets: list, max_norm: float, mesh=None, norm_type: float = 2.0) -> torch.Tensor:
    """The global norm of ``pieces`` [(parameter whose marks count it, gradient, is a dp
    shard)], each counted once over the world (`_counted`), and every tensor of ``targets``
    scaled by min(1, max_norm / (norm + 1e-6)); returns the norm before. It is `local_norm`,
    one all-reduce, `global_norm` and `scale_gradients` (post-validation runs them apart)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    local, targets, norm_type = local_norm(pieces, targets, mesh, norm_type)
    if local.dim() == 1:  # several ranks: every rank's sum of squares (or max) is the whole model's
        comms.all_reduce(local, op=dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX)
    total = global_norm(local, norm_type)
    scale_gradients(targets, total, max_norm)
    return total


def local_norm(pieces: list, targets: list, mesh=None, norm_type: float = 2.0):
    """This rank's part of the global norm of ``pieces`` (`grad_pieces`, `flat_grad_pieces`),
    before any communication: (a (1,) tensor holding
    its sum of g^2 over what it counts (its max for inf), to be all-reduced over the world, or,
    with one process, the 0-dim norm itself; the gradients to scale; norm_type as a float).
    `clip_pieces` is this, one all-reduce, `global_norm` and `scale_gradients`."""
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type must be 2 or inf, got {norm_type!r}")
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
        return total, targets, norm_type
    local = torch.zeros(1, device=device)  # this rank's sum of squares (or max)
    if norms:
        local[0] = torch.stack(norms).square().sum() if norm_type == 2.0 else torch.stack(norms).max()
    return local, targets, norm_type


def global_norm(reduced: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    """The norm from `local_norm`'s value once all-reduced (or one process's norm, as it is)."""
    if reduced.dim() == 0:
        return reduced
    return reduced[0].sqrt() if norm_type == 2.0 else reduced[0]


@torch.no_grad()
def clipped(total: torch.Tensor, max_norm: float) -> bool:
    """Whether `scale_gradients` changes anything: max_norm / (total + 1e-6) < 1 (or a NaN norm)."""
    coef = max_norm / (total + 1e-6)
    return not bool(coef >= 1.0)


@torch.no_grad()
def scale_gradients(targets, total: torch.Tensor, max_norm: float) -> None:
    """Every gradient times min(1, max_norm / (total + 1e-6)), torch's formula, 1e-6 included."""
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in targets:
        g.mul_(clip_coef.to(device=g.device, dtype=g.dtype))
