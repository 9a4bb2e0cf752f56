"""How should `launch` start its ranks? Time and safety of fork, spawn and forkserver.

    python bench/launch_methods.py [--world 2] [--repeat 3]

Each start method runs in a fresh interpreter that, like a notebook kernel, has
already used OpenMP (a large matmul) before it launches. Each launch runs a rank
function that itself multiplies matrices with two intra-op threads and does an
all-reduce. Printed: seconds for the first launch (includes starting the fork
server) and the median of the next ones, or HANG when the ranks did not finish.
"""
import argparse
import statistics
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    from reference.runtime import launch, RankTimeoutError

    def work():
        a = torch.randn(512, 512)
        _ = a @ a                     # an OpenMP parallel region on the rank
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    if __name__ == "__main__":
        method, world, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        x = torch.randn(1024, 1024)
        _ = x @ x                     # the caller used OpenMP, as a kernel usually has
        times = []
        for _ in range(repeat + 1):
            start = time.perf_counter()
            try:
                launch(work, world, start_method=method, threads=2, timeout=20, quiet=True)
            except RankTimeoutError:
                print("HANG")
                sys.exit(0)
            times.append(time.perf_counter() - start)
        print(" ".join(f"{t:.3f}" for t in times))
""")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{'method':<11} {'first launch':>13} {'next (median)':>14}")
    for method in ("forkserver", "spawn", "fork"):
        out = subprocess.run([sys.executable, "-c", CHILD, method, str(args.world),
                              str(args.repeat)], capture_output=True, text=True, timeout=300)
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "ERROR"
        if line in ("HANG", "ERROR"):
            print(f"{method:<11} {line:>13} {'':>14}")
            if line == "ERROR":
                print(out.stderr[-2000:])
            continue
        times = [float(t) for t in line.split()]
        print(f"{method:<11} {times[0]:>12.2f}s {statistics.median(times[1:]):>13.2f}s")


if __name__ == "__main__":
    main()
