"""The course's Megatron block against PyTorch's DTensor tensor parallelism, same block, same ranks.

    python bench/tp_vs_dtensor.py [--worlds 2 4] [--steps 20] [--batch 4] [--seq 128] [--embd 256]

One transformer block of `reference.model` is split two ways on gloo CPU ranks:

* ours: `ParallelCausalSelfAttention` and column/row `ParallelLinear`s from
  `reference.tensor_parallel` (Megatron's f and g as autograd functions);
* PyTorch's: ``parallelize_module`` with ``ColwiseParallel`` on c_attn and c_fc,
  ``RowwiseParallel`` on both c_proj. A contiguous column split of the fused
  [q | k | v] projection would hand rank 0 all of q and part of k, so its rows are
  first reordered to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: each rank then holds
  whole heads, and both versions compute the dense block's function (checked).

A step is forward and backward of the block. The two versions alternate step by
step in the same run, so machine load affects both alike; a step's time is the
slowest rank's, and the table shows the median over steps and the ratio.
"""
import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist

from reference.mesh import Mesh
from reference.model import Block, GPTConfig
from reference.runtime import launch
from reference.tensor_parallel import (
    ColumnParallelLinear, ParallelCausalSelfAttention, RowParallelLinear, column_shard,
)


def megatron_block(block, group):
    tp = copy.deepcopy(block)
    tp.attn = ParallelCausalSelfAttention.from_dense(block.attn, group)
    tp.ffn.c_fc = ColumnParallelLinear.from_dense(block.ffn.c_fc, group)
    tp.ffn.c_proj = RowParallelLinear.from_dense(block.ffn.c_proj, group)
    return tp


def dtensor_block(block, n):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = copy.deepcopy(block)
    with torch.no_grad():  # heads laid out rank by rank, so a contiguous split keeps them whole
        for p in (tp.attn.c_attn.weight, tp.attn.c_attn.bias):
            p.copy_(torch.cat([column_shard(p, r, n, chunks=3) for r in range(n)]))
    plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "ffn.c_fc": ColwiseParallel(), "ffn.c_proj": RowwiseParallel()}
    return parallelize_module(tp, init_device_mesh("cpu", (n,)), plan)


def _step(block, x):
    out, _ = block(x)
    out.sum().backward()
    block.zero_grad(set_to_none=True)
    return out


def _bench(cfg, batch, steps, warmup):
    n = dist.get_world_size()
    mesh = Mesh(tp=n).build_groups()
    torch.manual_seed(0)
    dense = Block(cfg)
    ours, theirs = megatron_block(dense, mesh.group("tp")), dtensor_block(dense, n)
    x = torch.randn(batch, cfg.block_size, cfg.n_embd)
    expected, _ = dense(x)
    for name, blk in (("ours", ours), ("DTensor", theirs)):
        got, _ = blk(x)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name} differs from the dense block: {m}")
    times = {"ours": [], "DTensor": []}
    for i in range(warmup + steps):
        for name, blk in (("ours", ours), ("DTensor", theirs)):
            dist.barrier()
            start = time.perf_counter()
            _step(blk, x)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    cfg = GPTConfig(n_embd=args.embd, n_head=args.heads, block_size=args.seq)
    print(f"block: B={args.batch} T={args.seq} C={args.embd} heads={args.heads} d_ff={cfg.d_ff}, "
          f"fp32, gloo CPU; median of {args.steps} forward+backward steps (slowest rank)")
    print(f"{'tp':>3} {'ours (ms)':>10} {'DTensor (ms)':>13} {'DTensor / ours':>15}")
    for n in args.worlds:
        per_rank = launch(_bench, n, cfg, args.batch, args.steps, args.warmup, timeout=600.0, quiet=True)
        med = {k: 1e3 * statistics.median(max(ts) for ts in zip(*(r[k] for r in per_rank)))
               for k in ("ours", "DTensor")}
        print(f"{n:>3} {med['ours']:>10.1f} {med['DTensor']:>13.1f} {med['DTensor'] / med['ours']:>15.2f}")


if __name__ == "__main__":
    main()
