"""The course's `fully_shard` (`reference.zero`) against PyTorch's `fully_shard` (FSDP2): bytes,
peak memory and time of one step on the same model, ranks and batches.

    python bench/fully_shard_vs_fsdp2.py [--world 2] [--dtype bf16] [--steps 4] [--rounds 3]

Both wrap the same GPT (`GPT.from_config_seed(GPTConfig.small(block_size=64), 0)`) with a unit
per block and the root, ``reshard_after_forward`` left at its default (True for the blocks,
False for the root), ``MixedPrecisionPolicy(param_dtype=--dtype, reduce_dtype=float32)``, and
train with AdamW. Ours keeps the LayerNorms' weights and biases replicated (their gradients
all-reduced); FSDP2 shards them too.

Printed, per implementation (rank 0, the second step):
* bytes this rank sends, by collective, counted the same way on both sides: a dispatch mode
  sees every c10d collective and charges it the ring algorithm's bytes
  (`compose_vs_pytorch.CollectiveBytes`, the course's formula); ours is also read from the
  course's meter (`reference.comms.meter`), which must agree;
* peak bytes alive during forward, backward and step (`reference.memory.PeakMemory`) plus the
  whole parameters' buffers, which both implementations regrow in place (a storage resize no
  dispatch mode sees): ours every unit's ``full``, FSDP2's unsharded parameters;
* the median seconds per step, the two alternating in rounds so that both see the same load.
Only ratios measured in one run mean anything: absolute times depend on the machine.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from compose_vs_pytorch import CollectiveBytes
from reference import comms
from reference.data import synthetic_batch
from reference.memory import PeakMemory
from reference.model import GPT, GPTConfig
from reference.runtime import launch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONFIG = GPTConfig.small(block_size=64)


def _ours(dtype):
    from reference.zero import MixedPrecisionPolicy, fully_shard

    model = GPT.from_config_seed(CONFIG, 0)
    mp = MixedPrecisionPolicy(param_dtype=None if dtype is torch.float32 else dtype, reduce_dtype=torch.float32)
    norms = {p for name, p in model.named_parameters() if ".ln_" in name or name.startswith("ln_f")}
    for block in model.h:
        fully_shard(block, mp_policy=mp, replicate_params=norms)
    fully_shard(model, mp_policy=mp, replicate_params=norms)
    units = [s.unit for m in model.modules() if (s := fully_shard.state(m)) is not None and s.unit is not None]
    whole = lambda: sum(u.full.untyped_storage().nbytes() for u in units)  # noqa: E731
    return model, whole


def _torch(dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = GPT.from_config_seed(CONFIG, 0)
    mp = MixedPrecisionPolicy(param_dtype=None if dtype is torch.float32 else dtype, reduce_dtype=torch.float32)
    for block in model.h:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    params = [fp for m in model.modules() if (s := fully_shard.state(m)) is not None
              for g in s._fsdp_param_groups for fp in g.fsdp_params]

    def whole():
        return sum(fp._unsharded_param.untyped_storage().nbytes() for fp in params
                   if hasattr(fp, "_unsharded_param"))
    return model, whole


def _step(model, opt, batch, step):
    x, y = synthetic_batch(batch, CONFIG.block_size, seed=dist.get_rank(), step=step)
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _rank(dtype_name, batch, steps, rounds):
    dtype = DTYPES[dtype_name]
    runs = {}
    for name, make in (("ours", _ours), ("fully_shard", _torch)):
        model, whole = make(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _step(model, opt, batch, 0)  # warm-up: first-call costs and the optimizer's state
        counter = CollectiveBytes((dist.get_world_size(), 1, 1, 3))
        with comms.meter() as meter, PeakMemory(also=whole) as peak, counter:
            loss = _step(model, opt, batch, 1)
        runs[name] = {"model": model, "opt": opt, "loss": loss, "peak": peak.peak_bytes,
                      "sent": dict(counter.by), "sent total": counter.sent, "meter": meter.sent_bytes(),
                      "times": []}
    for r in range(rounds):
        for run in runs.values():
            for s in range(steps):
                dist.barrier()
                start = time.perf_counter()
                _step(run["model"], run["opt"], batch, 2 + r * steps + s)
                dist.barrier()
                run["times"].append(time.perf_counter() - start)
    return {name: {k: v for k, v in run.items() if k not in ("model", "opt")}
            | {"median": statistics.median(run["times"])} for name, run in runs.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    args = parser.parse_args()
    n_params = GPT(CONFIG).num_parameters()
    print(f"GPT {CONFIG.n_layer} layers, n_embd {CONFIG.n_embd}, {n_params / 1e6:.2f}M parameters; "
          f"{args.world} gloo ranks, {args.batch} x {CONFIG.block_size} tokens per rank; "
          f"param_dtype {args.dtype}, reduce_dtype fp32; median of {args.rounds} x {args.steps} steps")
    res = launch(_rank, args.world, args.dtype, args.batch, args.steps, args.rounds,
                 backend="gloo", timeout=1200, quiet=True)[0]
    ours, theirs = res["ours"], res["fully_shard"]
    print(f"second step's loss on rank 0: ours {ours['loss']:.6f}, fully_shard {theirs['loss']:.6f}")
    print(f"ours: the course's meter {ours['meter']:,} bytes, the dispatch count {ours['sent total']:,}")
    print(f"{'':24} {'ours':>14} {'fully_shard':>14} {'ours / theirs':>14}")
    for key in sorted(set(ours["sent"]) | set(theirs["sent"])):
        a, b = ours["sent"].get(key, 0), theirs["sent"].get(key, 0)
        ratio = f"{a / b:>13.2f}x" if b else f"{'-':>14}"  # (FSDP2 all-reduces nothing: it shards the norms)
        print(f"{'sent, ' + key[0]:<24} {a:>14,} {b:>14,} {ratio}")
    for label, key, fmt in (("sent, all", "sent total", ","), ("peak bytes", "peak", ","),
                            ("s / step", "median", ".4f")):
        a, b = ours[key], theirs[key]
        print(f"{label:<24} {a:>14{fmt}} {b:>14{fmt}} {a / b:>13.2f}x")


if __name__ == "__main__":
    main()
