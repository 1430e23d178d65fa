"""Real FFT cost per point by transform length: why the fft backend's last dim takes an even length (issue 28).

For every 5-smooth length in a few ranges, a real forward and inverse transform (torch.fft.rfft + irfft, pocketfft on
the CPU) of about 2^21 points in rows of that length, timed as CPU time (time.process_time, the best of --reps) so
that the ratios hold on a shared machine; printed as ns per point with the length's exponents of 2, 3 and 5.
``backends.fft.sizing.fft_size`` reads the result: odd lengths cost about twice as much per point as even ones near
them.

    PYTHONPATH=src python benchmarks/fft_sizes.py --threads 1 [--reps 5] [--out benchmarks/results/fft_sizes.md]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable

import torch

RANGES = ((16, 130), (480, 560), (960, 1100), (1900, 2100), (15900, 16400))


def exponents(n: int) -> tuple[tuple[int, int, int], int]:
    """(a, b, c) with n = 2^a 3^b 5^c r, and r."""
    found = []
    for p in (2, 3, 5):
        k = 0
        while n % p == 0:
            n, k = n // p, k + 1
        found.append(k)
    return (found[0], found[1], found[2]), n


def cpu_time(f: Callable[[], object], reps: int) -> float:
    f()
    best = float("inf")
    for _ in range(reps):
        start = time.process_time()
        f()
        best = min(best, time.process_time() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = ["| length | 2^a 3^b 5^c | odd | ns per point (rfft + irfft) |", "|---|---|---|---|"]
    for lo, hi in RANGES:
        for n in range(lo, hi + 1):
            (a, b, c), rest = exponents(n)
            if rest != 1:
                continue
            rows = max(1, 2**21 // n)
            x = torch.randn(rows, n)
            spectrum = torch.fft.rfft(x)
            seconds = (cpu_time(lambda x=x: torch.fft.rfft(x), args.reps)
                       + cpu_time(lambda s=spectrum, n=n: torch.fft.irfft(s, n=n), args.reps))
            lines.append(f"| {n} | {a} {b} {c} | {'yes' if n % 2 else ''} | {seconds / (rows * n) * 1e9:.2f} |")
            print(lines[-1], flush=True)
    if args.out:
        command = "PYTHONPATH=src python benchmarks/fft_sizes.py " + shlex.join(sys.argv[1:] if argv is None else argv)
        head = [f"torch {torch.__version__}, {args.threads} thread(s), CPU time, best of {args.reps} (noisy: a shared "
                "machine).", "", f"    {command}", ""]
        with open(args.out, "w") as f:
            f.write("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
