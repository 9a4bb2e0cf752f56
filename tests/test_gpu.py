"""The same launch on GPUs: NCCL with one GPU per rank. Skipped without a GPU."""
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from reference import runtime
from reference.runtime import launch

gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(gpus < 1, reason="needs a CUDA GPU")


def _both_kinds_of_tensor():
    dev = runtime.device()
    on_gpu = torch.ones(4, device=dev) * (dist.get_rank() + 1)
    on_cpu = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(on_gpu)   # NCCL
    dist.all_reduce(on_cpu)   # gloo: CPU tensors keep working under NCCL
    return str(dev), str(dist.get_backend()), on_gpu.cpu(), on_cpu


@needs_gpu
def test_nccl_with_one_gpu_per_rank():
    world = min(gpus, 2)
    results = launch(_both_kinds_of_tensor, world, backend="auto", quiet=True, timeout=120)
    expected = torch.full((4,), world * (world + 1) / 2)
    for rank, (dev, backend, g, c) in enumerate(results):
        assert dev == f"cuda:{rank}"
        assert "nccl" in backend
        torch.testing.assert_close(g, expected, rtol=0, atol=0)
        torch.testing.assert_close(c, expected, rtol=0, atol=0)


@needs_gpu
def test_launch_after_the_caller_used_cuda():
    """The fork server never touched CUDA, so ranks can use it whatever the caller did."""
    torch.ones(1, device="cuda").sum().item()
    assert launch(lambda: str(runtime.device()), 1, backend="nccl", quiet=True) == ["cuda:0"]


@needs_gpu
def test_fork_refuses_once_cuda_is_initialised():
    code = ("import torch; from reference import runtime\n"
            "torch.ones(1, device='cuda')\n"
            "try:\n    runtime.resolve_backend('auto', 1, start_method='fork')\n"
            "except RuntimeError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "refused: CUDA is already initialised" in out.stdout, out.stderr
