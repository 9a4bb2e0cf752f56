"""The composed GPT's options against each other: which combinations train and equal one process.

    python bench/sweep_3d.py            # the all-pairs set (what tests/test_parallel_sweep.py runs)
    python bench/sweep_3d.py --full     # every accepted case of the full product (hours)
    python bench/sweep_3d.py --markdown # the tables as docs/sweep.md shows them

Prints one row per accepted case (world size, the largest relative loss difference and
absolute weight difference against one process after 3 AdamW steps, within tolerance or
not) and one row per refused pair with `ParallelConfig.validate`'s reason. One launch per
world size runs all of that size's cases; a progress bar counts the cases.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the package, and the sweep the tests run

from tqdm import tqdm  # noqa: E402

from sweep import covering_set, full_product, pair_reason  # noqa: E402
from sweep_run import TOLERANCES, compare, run_cases, single_process  # noqa: E402

from reference.runtime import launch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the full product, not the all-pairs set")
    p.add_argument("--markdown", action="store_true", help="print docs/sweep.md's tables")
    p.add_argument("--chunk", type=int, default=12, help="cases per launch")
    args = p.parse_args(argv)
    accepted, refused = covering_set()
    if args.full:
        accepted, refused = list(full_product()), []
    by_world = defaultdict(list)
    for case in accepted:
        by_world[case.world_size].append(case)
    rows = []
    with tqdm(total=len(accepted), desc="cases", unit="case") as bar:
        for world, cases in sorted(by_world.items()):
            for i in range(0, len(cases), args.chunk):
                part = cases[i:i + args.chunk]
                ranks = launch(run_cases, world, part, timeout=1800)
                for j, case in enumerate(part):
                    rows.append(compare(case, ranks[0][j], single_process(case)))
                    bar.update(1)
    bad = [r for r in rows if not r["ok"]]
    tol = "; ".join(f"{k}: losses rtol {v['loss'].rtol:g}, weights atol {v['weights'].atol:.2g}, "
                    f"mean {v['weights'].mean_atol:.2g}" for k, v in TOLERANCES.items())
    if args.markdown:
        print(f"{len(rows)} accepted cases, {len(rows) - len(bad)} equal to one process ({tol}).\n")
        print("| world | case | loss, relative | weights, largest | weights, mean |")
        print("|---|---|---|---|---|")
        for r in sorted(rows, key=lambda r: (r["world_size"], r["case"])):
            mark = "" if r["ok"] else " **outside tolerance**"
            print(f"| {r['world_size']} | `{r['case']}` | {r['loss_rel']:.1e} | {r['weight_abs']:.1e} | "
                  f"{r['weight_mean']:.1e}{mark} |")
        print(f"\n{len(refused)} pairs refused, each with `ParallelConfig.validate`'s reason:\n")
        print("| pair | reason |")
        print("|---|---|")
        for (a, va), (b, vb), _, reason in refused:
            print(f"| {a}={va}, {b}={vb} | {pair_reason(reason, a, b)} |")
    else:
        for r in rows:
            print(f"{'ok ' if r['ok'] else 'BAD'} world {r['world_size']}  loss {r['loss_rel']:.1e}  "
                  f"weights {r['weight_abs']:.1e}  {r['case']}")
            for why in r["why"]:  # what the tolerance check said
                print(f"    {why}")
        for (a, va), (b, vb), _, reason in refused:
            print(f"refused {a}={va} with {b}={vb}: {reason}")
        print(f"{len(rows)} accepted, {len(bad)} outside tolerance ({tol}); {len(refused)} pairs refused")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
