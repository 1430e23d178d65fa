"""The fft backend's floor on the large suite: what its FFT library calls alone cost, against native's time.

Per layer, float32, in one process: native's forward and backward (both gradients) and fft's, interleaved
(``large_kernels.time_interleaved``); then fft's forward and backward under the torch profiler, whose self times
of ``aten::_fft_r2c``, ``aten::_fft_c2r`` and ``aten::_fft_c2c`` are the transforms' share (pocketfft's calls at
the plan's sizes, already pruned). "ceiling" is native's time over the transforms' time: the speed-up fft would
reach if its pads, per-bin products, copies and crops cost nothing. Where the ceiling is below a target, no
tuning of the rest reaches it; only fewer or cheaper transforms would (issue 28's forward target of 5x, and its
>= 4x backward on every depthwise layer).

    PYTHONPATH=src python benchmarks/fft_floor.py --threads 2 --out benchmarks/results/fft_floor.md

``--layers PATTERN ...`` picks layers of the large suite (default: all). Ratios on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from large_kernels import time_interleaved

from convgrad.backends import get_backend
from convgrad.backends.native import forward as native_forward
from convgrad.cli.bench.layers import Layer, select

TRANSFORMS = ("aten::_fft_r2c", "aten::_fft_c2r", "aten::_fft_c2c")
# The depthwise large-kernel rows whose geomeans issue 28's targets judge (the grouped, strided, transposed rows
# and the controls are judged otherwise)
DEPTHWISE = ("replknet.dw31", "slak.dw51x5", "unireplknet.dw13", "hyena.long1d", "sincnet.k251", "3duxnet.dw7x7x7")


def transform_seconds(f: Callable[[], object], calls: int = 5) -> float:
    """Seconds per call of f spent in the FFT library's ops (their self time, torch profiler), over ``calls``."""
    f()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            f()
    total_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in TRANSFORMS)
    return total_us * 1e-6 / calls


def measure(layer: Layer, min_time: float) -> dict[str, float]:
    """Native's and fft's forward and backward times, and the transforms' share of fft's, in seconds."""
    spec = layer.spec()
    x, w, gy = (torch.randn(s) for s in (spec.input_shape, spec.weight_shape, spec.output_shape))
    native, fft = get_backend("native"), get_backend("fft")
    calls: dict[str, Callable[[], object]] = {
        "native_fwd": lambda: native_forward(spec, x, w, None),
        "fft_fwd": lambda: fft.forward(spec, x, w),  # type: ignore[attr-defined]
        "native_bwd": lambda: native.gradients(spec, gy, x, w, True, True),
        "fft_bwd": lambda: fft.gradients(spec, gy, x, w, True, True),
    }
    times = time_interleaved(calls, min_time)
    times["fwd_transforms"] = transform_seconds(calls["fft_fwd"])
    times["bwd_transforms"] = transform_seconds(calls["fft_bwd"])
    return times


def _row(name: str, t: dict[str, float]) -> str:
    cells = []
    for k in ("fwd", "bwd"):
        cells += [f"{t[f'native_{k}'] * 1e3:.1f}", f"{t[f'fft_{k}'] * 1e3:.1f}", f"{t[f'{k}_transforms'] * 1e3:.1f}",
                  f"{t[f'{k}_transforms'] / t[f'fft_{k}']:.0%}", f"{t[f'native_{k}'] / t[f'fft_{k}']:.2f}",
                  f"{t[f'native_{k}'] / t[f'{k}_transforms']:.2f}"]
    return f"| {name} | " + " | ".join(cells) + " |"


HEADER = ("| layer | native fwd ms | fft fwd ms | its transforms ms | transforms' share | fft fwd x native | "
          "fwd ceiling x native | native bwd ms | fft bwd ms | its transforms ms | transforms' share | "
          "fft bwd x native | bwd ceiling x native |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def geomean(values: list[float]) -> float:
    """The geometric mean (nan for none)."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", metavar="PATTERN", help="layers of the large suite (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per timing (default 0.3)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines, results = [HEADER], {}
    print(HEADER, flush=True)
    for layer in select("large", args.layers):
        results[layer.name] = measure(layer, args.min_time)
        lines.append(_row(layer.name, results[layer.name]))
        print(lines[-1], flush=True)
    rows = [results[n] for n in DEPTHWISE if n in results]
    if rows:
        lines.append("")
        for k in ("fwd", "bwd"):
            lines.append(f"Over the depthwise large-kernel rows measured ({len(rows)} of {len(DEPTHWISE)}), {k}: "
                         f"fft {geomean([t[f'native_{k}'] / t[f'fft_{k}'] for t in rows]):.2f}x native on geomean, "
                         f"ceiling {geomean([t[f'native_{k}'] / t[f'{k}_transforms'] for t in rows]):.2f}x.")
        print("\n".join(lines[-3:]), flush=True)
    if args.out:
        command = "PYTHONPATH=src python " + shlex.join(["benchmarks/fft_floor.py", *(argv or sys.argv[1:])])
        args.out.write_text(f"`{command}` (threads={args.threads}; torch {torch.__version__}, float32; times are "
                            "medians of torch.utils.benchmark, transforms the profiler's self time of the FFT ops; "
                            "noisy on a shared machine)\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
