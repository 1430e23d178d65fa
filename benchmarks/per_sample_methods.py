"""One layer's per-sample weight gradients by each method (native, unfold, conv) against PyTorch's one summed
weight gradient: the figures behind per_sample/methods.py's "native" and its ``NATIVE_POSITIONS``.

torch.utils.benchmark, float32, CPU. Prints a markdown table (ms per call, median), and with ``--out`` writes it.

Usage:
    PYTHONPATH=src python benchmarks/per_sample_methods.py --threads 2
    PYTHONPATH=src python benchmarks/per_sample_methods.py --batch 4 --min-time 0.01   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from torch.utils import benchmark

from convgrad.backends import get_backend
from convgrad.per_sample import methods
from convgrad.spec import ConvSpec

# (name, C_in, C_out, H): 3x3, stride 1, padding 1
LAYERS = [("small CNN 32->64, 16x16", 32, 64, 16), ("ResNet-18 64->64, 32x32", 64, 64, 32),
          ("ResNet-18 128->128, 16x16", 128, 128, 16), ("256->256, 8x8", 256, 256, 8), ("512->512, 4x4", 512, 512, 4)]
METHODS = ("native", "unfold", "conv")


def _ms(fn: object, min_time: float) -> float:
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())  # its default is 1
    return timer.blocked_autorange(min_run_time=min_time).median * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds of timing per cell (default 1)")
    parser.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = [f"batch {args.batch}, {args.threads} threads, float32, ms per call (median)", "",
             "| layer | " + " | ".join(METHODS) + " | summed |", "|---|" + "---|" * (len(METHODS) + 1)]
    for name, c_in, c_out, h in LAYERS:
        spec = ConvSpec.from_shapes((args.batch, c_in, h, h), (c_out, c_in, 3, 3), 1, 1)
        x, y = torch.randn(spec.input_shape), torch.randn(spec.output_shape)  # forward conv: x input, y grad_output
        calls = [functools.partial(methods.weight_grad, spec, x, y, m) for m in METHODS]
        calls.append(functools.partial(get_backend("native").weight_grad, spec, x, y))
        cells = [_ms(call, args.min_time) for call in calls]
        lines.append(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
