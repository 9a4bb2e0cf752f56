"""Step time of the course's ZeRO-3 (`reference.zero.FSDP`) against PyTorch's `fully_shard`.

    python bench/zero3_vs_fsdp.py [--world 4] [--steps 8] [--rounds 3]

Both wrap the same GPT (one unit per block plus the root), start from the same
weights and train with AdamW on the same batches, on `--world` gloo ranks. The
two alternate in rounds inside one launch, so that both see the same machine
load; each round times `--steps` steps after a warm-up step. Printed: the
median seconds per step of each and their ratio (ours / PyTorch's), and the
same for ours without prefetching, which shows what the overlap buys. Only
ratios measured in one run mean anything: absolute times depend on the machine.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from reference.data import synthetic_batch
from reference.model import GPT, GPTConfig
from reference.runtime import launch
from reference.zero import FSDP


def _ours(model, prefetch=True):
    fsdp = FSDP(model, prefetch=prefetch)
    return fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-3)


def _torch(model):
    from torch.distributed.fsdp import fully_shard
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _time_steps(runner, optim, config, batch, steps, first_step):
    rank = dist.get_rank()
    times = []
    for step in range(first_step, first_step + steps):
        x, y = synthetic_batch(batch, config.block_size, seed=rank, step=step)
        dist.barrier()  # every rank starts the step together
        start = time.perf_counter()
        _, loss = runner(x, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        dist.barrier()  # a step ends when the slowest rank ends it
        times.append(time.perf_counter() - start)
    return times


def _rank(config, batch, steps, rounds):
    makers = {"ours": _ours, "ours, no prefetch": lambda m: _ours(m, prefetch=False), "torch": _torch}
    runs = {name: make(GPT.from_config_seed(config, 0)) for name, make in makers.items()}
    for name, (runner, optim) in runs.items():  # warm up: first-call costs out of the timing
        _time_steps(runner, optim, config, batch, 1, 0)
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name, (runner, optim) in runs.items():
            times[name] += _time_steps(runner, optim, config, batch, steps, 1 + r * steps)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    args = parser.parse_args()
    config = GPTConfig.small(block_size=64)
    n_params = GPT(config).num_parameters()
    print(f"GPT {config.n_layer} layers, n_embd {config.n_embd}, {n_params / 1e6:.2f}M parameters; "
          f"{args.world} gloo ranks, {args.batch} x {config.block_size} tokens per rank; "
          f"median of {args.rounds} x {args.steps} steps")
    medians = launch(_rank, args.world, config, args.batch, args.steps, args.rounds,
                     backend="gloo", timeout=1200, quiet=True)[0]
    torch_time = medians["torch"]
    print(f"{'implementation':<22} {'s / step':>9} {'vs fully_shard':>15}")
    for name, t in medians.items():
        print(f"{name:<22} {t:9.4f} {t / torch_time:14.2f}x")


if __name__ == "__main__":
    main()
