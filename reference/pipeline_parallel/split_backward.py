"""A backward in two halves, as zero-bubble schedules run it: I now, W later, W holding only what it needs.

A linear layer Y = X A^T (+ b) has two products in its backward: dX = dY A, which the previous
stage waits for, and dA = dY^T X (db = the sum of dY's rows), which nobody waits for. Qi et al.
(2024, "Zero Bubble Pipeline Parallelism") split a stage's backward along that line (the letters
are torch.distributed.pipelining's); their implementation and DeepSeek's DualPipe do it in the
linear layer itself, which puts its weight product in a store (``WeightGradStore``) instead of
computing it, and this module does the same:

* F, under `WeightStore.recording`: every ``F.linear`` of a trainable weight of the stage runs as
  `DeferredLinear`, the same product, whose backward computes dX and hands (X, dY) to the
  micro-batch's `WeightStore`, when the rank runs that micro-batch's backward as an I and a W (a
  whole B, DualPipeV's, keeps autograd's own graph, as 1F1B). The model is not changed: a ``TorchFunctionMode`` swaps the call
  while F runs (also inside a tensor-parallel layer, an expert, the router's gate).
* I (`backward_input`): the whole backward of the micro-batch, the full B of the executor
  (``retain_graph=False``: autograd frees what F stored as it goes), with the linear layers'
  weight products left in the store. Everything else is computed at once: the LayerNorms' and
  embeddings' gradients and a bias added apart (a row-parallel layer's) are reductions over the
  tokens that would hold as much as they cost, and the head's product runs at once too (its dY,
  the (b, T, V) logits' gradient, is the largest tensor of the model: `held_bytes_of_head`).
* W (`backward_weight`): for each stored layer dA = dY^T X and db, added into ``.grad``.

So from its I to its W a micro-batch holds each linear layer's X and dY and nothing else
(`reference.pipeline_parallel.costs.held_bytes_per_block`: 16 b T C a dense block, about what its
F stored), and W runs no collective. The products are autograd's own, in its order (dX = dY A as
``addmm``'s backward, dA = dY^T X, db summed as the engine sums a broadcast bias; under autocast
each in the autocast dtype, cast back as autocast's copies are), so the gradients are bit for bit
those of the full backward.
"""
from __future__ import annotations

import weakref
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from reference.pipeline_parallel.actions import Action
from reference.pipeline_parallel.forward_backward import Kept, RankState, backward, forward

__all__ = ["WeightStore", "DeferredLinear", "forward_recording", "backward_input", "backward_weight"]


def _autocast_dtype(x: torch.Tensor):
    """The dtype autocast would run a linear layer in on ``x``'s device, or None when it is off."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _cast(t, dtype):
    """As autocast casts a linear layer's argument: floating point but not float64, to ``dtype``."""
    if dtype is None or t is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


class DeferredLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward computes dX now and leaves dA, db to `WeightStore.run`."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        dtype = _autocast_dtype(x)
        x = _cast(x, dtype)  # autocast's copy of the input, the one its product saves
        with torch.autocast(x.device.type, enabled=False) if dtype is not None else nullcontext():
            y = F.linear(x, _cast(weight, dtype), _cast(bias, dtype))  # (.., out)
        ctx.save_for_backward(x)  # X (the parameters are referred to: W adds into their .grad)
        ctx.weight, ctx.bias, ctx.dtype, ctx.store = weight, bias, dtype, store
        return y

    @staticmethod
    def backward(ctx, dy):  # dy: (.., out)
        (x,) = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:  # dX = dY A, in the product's dtype (the engine casts it back)
            dx = dy.reshape(-1, dy.shape[-1]).mm(_cast(ctx.weight, ctx.dtype)).view(x.shape)
        ctx.store.put(x, dy, ctx.weight, ctx.bias)
        return dx, None, None, None


class _Recording(TorchFunctionMode):
    """Every ``F.linear`` of one of ``store``'s weights, with autograd recording, as `DeferredLinear`."""

    def __init__(self, store: "WeightStore"):
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight, bias = _linear_args(*args, **kwargs)
            if id(weight) in self.store.weights:
                return DeferredLinear.apply(x, weight, bias, self.store)
        return func(*args, **kwargs)


def _linear_args(input, weight, bias=None):
    return input, weight, bias


class WeightStore:
    """What one micro-batch's W needs on one chunk: each deferred linear layer's input X and
    output gradient dY (the sources' ``WeightGradStore``, one per micro-batch and chunk).

    ``weights``: the parameters whose linear layers defer their products (the stage's trainable
    weights less the head's)."""

    def __init__(self, weights):
        self.params = list(weights)  # kept, so that their ids stay theirs
        self.weights = {id(p) for p in self.params}
        self.entries: list[tuple] = []  # (X, dY, weight, bias), in the order I met them

    def recording(self):
        """While F (or its recomputation) runs: the linear layers of ``weights`` as `DeferredLinear`."""
        return _Recording(self)

    def put(self, x, dy, weight, bias) -> None:
        self.entries.append((x, dy, weight, bias))

    def nbytes(self) -> int:
        """Bytes of the X and dY held (distinct storages: an X may be F's saved tensor, a dY a view)."""
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for entry in self.entries for t in entry[:2]}.values())

    @torch.no_grad()
    def run(self) -> None:
        """W: dA = dY^T X and db = the sum of dY's rows, added into ``.grad`` (as AccumulateGrad), freed."""
        while self.entries:
            x, dy, weight, bias = self.entries.pop(0)
            dy = dy.reshape(-1, dy.shape[-1])  # (b T, out)
            if weight.requires_grad:
                _accumulate(weight, dy.t().mm(x.reshape(-1, x.shape[-1])))  # (out, in)
            if bias is not None and bias.requires_grad:
                _accumulate(bias, dy.sum_to_size(bias.shape))  # (out,)


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    g = g.to(p.dtype)  # autocast's copy of the weight took its gradient in the autocast dtype
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g


def _deferred_weights(stage: torch.nn.Module, head: bool) -> list:
    """The stage's trainable parameters whose linear layers defer their products: all but the
    head's (``lm_head``, when the stage holds the head)."""
    skip = {id(p) for name, p in stage.named_parameters() if head and "lm_head" in name.split(".")}
    return [p for p in stage.parameters() if p.requires_grad and id(p) not in skip]


_SPLIT = weakref.WeakKeyDictionary()  # schedule -> {rank: the (mb, chunk) whose backward it splits}


def _split(state: RankState, a: Action) -> bool:
    """Whether the rank (``state``) runs the backward of ``a``'s micro-batch and chunk as an I and a W."""
    by_rank = _SPLIT.setdefault(state.schedule, {})
    if state.rank not in by_rank:
        by_rank[state.rank] = {(b.mb, b.chunk) for b in state.schedule.actions(state.rank) if b.op == "I"}
    return (a.mb, a.chunk) in by_rank[state.rank]


def forward_recording(state: RankState, a: Action) -> None:
    """F: when its backward is split (an I, then a W), the stage's linear layers recorded as
    `DeferredLinear`, their store kept beside what F keeps; else the plain F."""
    if not _split(state, a):
        return forward(state, a)
    store = WeightStore(_deferred_weights(state.stages[a.chunk], state.ends(a.chunk)[1]))
    with store.recording():
        forward(state, a)
    state.kept[(a.mb, a.chunk)].weights = store


def backward_input(state: RankState, a: Action) -> None:
    """I: the backward of micro-batch ``a.mb`` on chunk ``a.chunk`` (`backward`: the input's
    gradient posted, what F stored freed), the linear layers' weight products left in its store.
    After it the micro-batch keeps its store alone."""
    store = state.kept[(a.mb, a.chunk)].weights or WeightStore(())  # F did not record: I is the whole B
    with store.recording():  # (a checkpointed chunk runs its F again here)
        backward(state, a)
    state.kept[(a.mb, a.chunk)] = Kept(None, weights=store)


def backward_weight(state: RankState, a: Action) -> None:
    """W: the weight products micro-batch ``a.mb``'s I left on chunk ``a.chunk``; its store freed."""
    state.kept.pop((a.mb, a.chunk)).weights.run()
