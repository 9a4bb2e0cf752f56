"""A backward in two halves, as zero-bubble schedules run it: I now, W later.

A linear layer Y = X A^T has two products in its backward: dX = dY A, which the previous stage
waits for, and dA = dY^T X, which nobody waits for. Qi et al. (2024, "Zero Bubble Pipeline
Parallelism") split a stage's backward along that line (the letters are torch.distributed.pipelining's):

* I (`backward_input`): ``torch.autograd.grad`` of the stage's input alone, with
  ``retain_graph=True``: autograd computes only what leads to the input (a tensor-parallel
  layer's collectives are on that path), and the gradient is posted to the previous stage at once.
  On its way I catches the gradient arriving at each *split point*, an autograd node on the
  input's path with a branch to parameters that leads nowhere near the input (a linear layer's
  matmul, a layer norm).
* W (`backward_weight`), later: from each split point with its caught gradient, the backward of
  that branch alone (``torch.autograd.backward`` of gradient edges, ``inputs`` its parameters):
  dA = dY^T X and no more, so no collective of tensor parallelism runs in W. The exception is an
  autograd function that computes both halves at once (the sequence-parallel column GEMM that
  gathers its input again): it runs whole in I and again in W, the gradient still counted once.

Every path from the output to a parameter leaves the input's path once and for all, at one split
point, so the split points' sum is the whole gradient (a parameter on two branches of one stage
would break that; `WeightPass` refuses it). On the first stage I has nothing to compute and W is
the whole backward. Between I and W a micro-batch holds what F stored, the caught gradients, and,
checkpointed, the forward run again (`reference.pipeline_parallel.accounting` measures it).
"""
from __future__ import annotations

from functools import partial

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from reference.pipeline_parallel.actions import Action
from reference.pipeline_parallel.forward_backward import RankState, backward_roots

__all__ = ["WeightPass", "backward_input", "backward_weight"]


def _children(node):
    return [c for c, _ in node.next_functions if c is not None]


def _postorder(roots) -> list:
    """Every autograd node under ``roots``, each after all the nodes below it."""
    out, seen, stack = [], set(), [(n, False) for n in roots]
    while stack:
        node, done = stack.pop()
        if done:
            out.append(node)
        elif node not in seen:
            seen.add(node)
            stack += [(node, True)] + [(c, False) for c in _children(node) if c not in seen]
    return out


class WeightPass:
    """The W of one micro-batch on one chunk: where its branches to the parameters start,
    the gradients I caught there, and the parameters each branch reaches."""

    def __init__(self, roots: list, x: torch.Tensor, params: list):
        tops = [t.grad_fn for t, _ in roots]
        order = _postorder(tops)
        target = get_gradient_edge(x).node if x.requires_grad else None
        leaf = {get_gradient_edge(p).node: p for p in params}
        on_path, below = set(), {}  # nodes that reach the input; non-path node -> its parameters
        for node in order:
            if node is target or any(c in on_path for c in _children(node)):
                on_path.add(node)
            else:
                below[node] = set().union(*(below[c] for c in _children(node))) | (
                    {node} if node in leaf else set())
        # split points: a node on the input's path, the parameters of its branches off it
        self.splits = {n: set().union(*(below[c] for c in _children(n) if c not in on_path))
                       for n in order if n in on_path}
        self.splits = {n: ps for n, ps in self.splits.items() if ps}
        # roots off the input's path (the first stage's, or an output that ignores the input)
        off = [(t, g) for t, g in roots if t.grad_fn not in on_path]
        self.off_roots = (off, set().union(*(below[t.grad_fn] for t, _ in off)))
        counted = [p for ps in [*self.splits.values(), self.off_roots[1]] for p in ps]
        if len(counted) != len(set(counted)):
            raise ValueError("a parameter is used on two branches of one stage: its W cannot be "
                             "split from I here (use the full backward B)")
        self.leaf, self.caught = leaf, {}

    def catch(self):
        """Hooks that keep the gradient arriving at each split point while I runs (remove them after)."""
        def keep(node, grads):
            self.caught[node] = grads

        return [n.register_prehook(partial(keep, n)) for n in self.splits]

    def caught_bytes(self) -> int:
        """Bytes of the gradients caught at the split points (distinct storages)."""
        return sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                    for grads in self.caught.values() for g in grads if g is not None}.values())

    def run(self) -> None:
        """W: every branch from its split point, gradients accumulated into the parameters' ``.grad``."""
        off, params = self.off_roots
        if off:
            torch.autograd.backward([get_gradient_edge(t) for t, _ in off],
                                    [torch.ones_like(t) if g is None else g for t, g in off],
                                    inputs=[self.leaf[p] for p in params], retain_graph=True)
        for node, params in self.splits.items():
            grads = self.caught.get(node, ())
            edges = [(GradientEdge(node, k), g) for k, g in enumerate(grads) if g is not None]
            if edges:
                torch.autograd.backward([e for e, _ in edges], [g for _, g in edges],
                                        inputs=[self.leaf[p] for p in params], retain_graph=True)
        self.caught.clear()


def backward_input(w: RankState, a: Action) -> None:
    """I: the gradient of micro-batch ``a.mb``'s input to chunk ``a.chunk``, posted back; what
    its W needs is kept (`WeightPass`) beside what its F kept."""
    kept, roots = backward_roots(w, a)
    params = [p for p in w.stages[a.chunk].parameters() if p.requires_grad]
    kept.weights = WeightPass(roots, kept.x, params)
    if not w.ends(a.chunk)[0]:
        hooks = kept.weights.catch()
        try:
            (dx,) = torch.autograd.grad([t for t, _ in roots], [kept.x], [g for _, g in roots],
                                        retain_graph=True, allow_unused=True)
        finally:
            for h in hooks:
                h.remove()
        w.mail.post("B", a.mb, a.chunk, dx if dx is not None else torch.zeros_like(kept.x))


def backward_weight(w: RankState, a: Action) -> None:
    """W: the weights' gradients of micro-batch ``a.mb`` on chunk ``a.chunk``; what its F and I
    kept is freed (the graph, which its split points kept alive, with it)."""
    w.kept.pop((a.mb, a.chunk)).weights.run()


