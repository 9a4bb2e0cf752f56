"""Measuring the memory of attention: what autograd saves, and the largest tensor any op makes.

* `SavedTensorBytes`: the bytes of the distinct storages autograd saves for backward, the
  activation memory an attention holds between forward and backward;
* `LargestTensor`: the largest tensor any operation creates while it is open, forward *and*
  backward, transient ones too (the (T/cp, T/cp) score block of one ring step, the (T, T)
  scores of a dense attention): a ``TorchDispatchMode``, which, unlike saved-tensor hooks,
  sees inside autograd Functions and the backward pass.

    with SavedTensorBytes() as saved, LargestTensor() as largest:
        out = ring_attention(q, k, v, group)
    out.sum().backward()      # wrap this too for the backward's tensors
    saved.bytes, largest.elements
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from reference.memory import SavedBytes

__all__ = ["SavedTensorBytes", "LargestTensor"]


class SavedTensorBytes(SavedBytes):
    """The core's meter of what autograd saves (`reference.memory.SavedBytes`, the pipeline's too),
    leaving out only the storages of ``exclude`` (the parameters, say)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        super().__init__(set(), exclude)


class LargestTensor(TorchDispatchMode):
    """The largest non-view tensor an operation creates inside the block: `elements` and `shape`."""

    def __init__(self):
        super().__init__()
        self.elements, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t._is_view() and t.numel() > self.elements:
                self.elements, self.shape = t.numel(), tuple(t.shape)
        return out
