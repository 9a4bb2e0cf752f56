"""The 3D step (dp 2 x tp 2 x pp 2 by default) against one process doing the same work.

    python bench/parallel_3d.py [--dp 2 --tp 2 --pp 2] [--steps 6] [--model small]

Each rank times `--steps` steps of `reference.parallel.train_step` after one warm-up step;
one process times the same global batch with the same gradient accumulation (dp x m chunks).
Printed: the median step time of each, their ratio (parallel / one process: on a CPU laptop
every rank shares the same cores, so above 1 is expected), and from the ranks' traces the
share of a step spent in the pipeline's messages (waiting included) and in the gradient
reduction; the tensor-parallel collectives run inside the forwards and backwards and are
counted there. On a GPU node the same script runs on NCCL, one GPU per rank.
"""
import argparse
import statistics
import time

import torch

from reference.model import GPT, GPTConfig
from reference.parallel import ParallelConfig, parallelize, train_step
from reference.runtime import device, launch


def _batch(cfg, B, step):
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, cfg.vocab_size, (B, cfg.block_size + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _sync():
    if device().type == "cuda":
        torch.cuda.synchronize()


def _rank(config, cfg, B, steps):
    torch.manual_seed(0)
    pm = parallelize(GPT(cfg).to(device()), config.mesh().build_groups(), config)
    opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
    times, shares = [], []
    for step in range(steps + 1):
        idx, tgt = _batch(cfg, B, step)
        _sync()
        t0 = time.perf_counter()
        result = train_step(pm, opt, idx, tgt)
        _sync()
        elapsed = time.perf_counter() - t0
        if step:  # the first step warms up
            times.append(elapsed)
            comm = sum(e.end - e.start for e in result.trace if e.kind in ("SEND", "RECV", "reduce"))
            shares.append(comm / elapsed)
    return statistics.median(times), statistics.median(shares)


def _single(cfg, B, chunks, steps):
    torch.manual_seed(0)
    model = GPT(cfg).to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 1):
        idx, tgt = _batch(cfg, B, step)
        _sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for x, y in zip(idx.chunk(chunks), tgt.chunk(chunks)):
            (model(x.to(device()), y.to(device()))[1] / chunks).backward()
        opt.step()
        _sync()
        if step:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", choices=["tiny", "small"], default="small")
    args = parser.parse_args()
    cfg = getattr(GPTConfig, args.model)()
    config = ParallelConfig(dp=args.dp, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
                            sequence_parallel=args.tp > 1)
    config.validate(config.world_size, cfg, batch=(args.batch, cfg.block_size))
    ranks = launch(_rank, config.world_size, config, cfg, args.batch, args.steps, timeout=1200)
    parallel = max(t for t, _ in ranks)  # the slowest rank sets the pace
    share = statistics.median(s for _, s in ranks)
    single = _single(cfg, args.batch, config.dp * config.microbatches, args.steps)
    print(f"{config} on {config.world_size} ranks, GPTConfig.{args.model}(), batch {args.batch}")
    print(f"  one process      {single * 1e3:8.1f} ms per step")
    print(f"  {config.world_size} ranks          {parallel * 1e3:8.1f} ms per step   ratio {parallel / single:.2f}")
    print(f"  messages and gradient reduction: {share:.0%} of a step (median over ranks)")


if __name__ == "__main__":
    main()
