"""What travels between the caller and its ranks: the function out, the results back.

* Out: the function and its arguments as one cloudpickle payload, which carries functions
  defined in `__main__` (a notebook cell) by value. A CUDA tensor travels as its CPU copy and
  is rebuilt on the rank's *current* device, its own GPU under NCCL (pickled the ordinary way
  it would land on cuda:0 on every rank). Tensors that share storage arrive as separate copies.
* Back: each rank's return value, every tensor mapped to the CPU, so reading a result never
  initialises CUDA in the caller (a kernel would create a context on every GPU returned from).
"""
from __future__ import annotations

import importlib
import io
import pickle
import sys
import types

import cloudpickle
import torch
import torch.nn as nn

from reference.runtime.errors import RankError

__all__ = ["dumps", "on_rank_device", "load_result"]


def _on_gpu(obj) -> bool:
    """A plain CUDA tensor or parameter (subclasses such as DTensor keep their own pickling)."""
    return type(obj) in (torch.Tensor, nn.Parameter) and obj.is_cuda


def _rank_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def on_rank_device(data: torch.Tensor, requires_grad: bool, parameter: bool) -> torch.Tensor:
    """Rebuild, in the rank, a CUDA tensor of the caller on this rank's current device."""
    t = data.to(_rank_device())
    return nn.Parameter(t, requires_grad=requires_grad) if parameter else t.requires_grad_(requires_grad)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, plus two rules: CUDA tensors travel as CPU copies rebuilt by `on_rank_device`, and
    modules of a ModuleType subclass (torch's config modules, such as torch.distributed.config) by
    name, which cloudpickle would try to copy by value and fail on."""

    def reducer_override(self, obj):
        if (isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType
                and sys.modules.get(obj.__name__) is obj):
            return importlib.import_module, (obj.__name__,)
        if isinstance(obj, torch.Tensor) and _on_gpu(obj):
            return on_rank_device, (obj.detach().cpu(), obj.requires_grad,
                                    type(obj) is nn.Parameter)
        return super().reducer_override(obj)


def dumps(obj) -> bytes:
    """The payload: `obj` pickled by value where needed, CUDA tensors bound for the rank's device."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _storage_on_cpu(data: bytes):
    # torch.storage._load_from_bytes, with the storage mapped to the CPU.
    return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")


class _CPUUnpickler(pickle.Unpickler):
    """pickle.Unpickler that rebuilds every tensor storage on the CPU."""

    def find_class(self, module, name):
        if module == "torch.storage" and name == "_load_from_bytes":
            return _storage_on_cpu
        return super().find_class(module, name)


def load_result(path: str, rank: int, safe_results: bool):
    """Read rank `rank`'s result file, every tensor on the CPU."""
    if safe_results:
        try:
            return torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:  # the rank returned something other than plain data
            raise RankError(f"rank {rank} returned a value that safe_results=True does not "
                            f"accept (only tensors, numbers, strings, lists, tuples and "
                            f"dicts): {str(exc).splitlines()[0]}", rank=rank) from None
    with open(path, "rb") as f:
        return _CPUUnpickler(f).load()
