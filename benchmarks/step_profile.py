"""Where a training step's convolution time goes, measured inside the step, and what a GEMM costs here.

Two tables, float32, on the CPU:

1. **In the step.** A CIFAR ResNet-18 (benchmarks/first_step.py, batch 32) under ``convgrad.patch`` with
   ``CONVGRAD_AUTOTUNE=fixed`` (every gradient by native's ``aten.convolution_backward``, as in plain torch)
   trains for ``--steps`` steps; every forward convolution and every backward is timed where it runs, between
   the BatchNorms and ReLUs of the step. Per layer configuration: the median forward and backward (ms), the
   backward over the forward (the bar of issue 16 is 2x: a backward does twice a forward's multiply-adds), and
   the sum per step. The same layers timed alone, back to back, can differ a lot (a 1x1 stride-2 backward took
   16 ms alone and 5 ms in the step on this machine), so a step's own figures are what a user meets.
2. **GEMM throughput.** The products that im2col formulations run (gemm's backend, the per-sample "unfold"),
   as ``torch.mm`` / ``torch.bmm`` (the BLAS: MKL in the CPU wheel) against the same product as a 1x1
   convolution (oneDNN), in GFLOP/s by ``torch.utils.benchmark``.

Usage:
    PYTHONPATH=src python benchmarks/step_profile.py --threads 2 --steps 12
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).parent))
import first_step

import convgrad as cg
import convgrad.autograd.function as cg_autograd  # the main Function reads native_forward from here
from convgrad.backends import auto, get_backend
from convgrad.spec import ConvSpec

GEMMS = ((2048, 2048, 2048), (512, 512, 4608), (64, 1024, 576))  # (M, K, N): square, ResNet's 512@4 gw, 64@32's


def _label(spec: ConvSpec) -> str:
    return (f"{spec.in_channels}->{spec.out_channels} @{spec.input_size[0]} k{spec.kernel_size[0]} "
            f"s{spec.stride[0]}")


def in_step(steps: int) -> list[dict[str, Any]]:
    """Per layer configuration: median forward and backward (s) and the layers of it per step."""
    auto.set_mode("fixed")
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    native, forward = get_backend("native"), cg_autograd.native_forward

    def timed_forward(spec: ConvSpec, *args: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = forward(spec, *args)
        times[_label(spec), "fwd"].append(time.perf_counter() - start)
        return out

    def timed_backward(self: Any, spec: ConvSpec, *args: Any) -> Any:
        start = time.perf_counter()
        out = native.backward(spec, *args)
        times[_label(spec), "bwd"].append(time.perf_counter() - start)
        return out

    model, _ = first_step._setup("resnet18")
    _, step = first_step._setup_for("resnet18", cg.patch(model))
    cg_autograd.native_forward, auto.AutoBackend.backward = timed_forward, timed_backward  # type: ignore[method-assign]
    for _ in range(3):
        step()
    times.clear()
    for _ in range(steps):
        step()
    rows = []
    for label in sorted({k for k, _ in times}, key=lambda s: (int(s.split("@")[1].split()[0]) * -1, s)):
        fwd, bwd = times[label, "fwd"], times[label, "bwd"]
        rows.append({"layer": label, "fwd": statistics.median(fwd), "bwd": statistics.median(bwd),
                     "per_step": len(fwd) // steps})
    return rows


def gemm_rates(threads: int) -> list[tuple[str, float, float]]:
    """(M x K x N, GFLOP/s of torch.mm, GFLOP/s of the same product as a 1x1 conv1d)."""
    out = []
    for m, k, n in GEMMS:
        a, b = torch.randn(m, k), torch.randn(k, n)
        flops = 2 * m * k * n
        timer = lambda stmt, **g: benchmark.Timer(stmt, globals=g, num_threads=threads)  # noqa: E731
        mm = timer("a @ b", a=a, b=b).blocked_autorange(min_run_time=0.5).median
        # (1, K, N) input, (M, K, 1) weight: out[m, n] = sum_k w[m, k] x[k, n]
        conv = timer("F.conv1d(x, w)", F=F, x=b.view(1, k, n), w=a.view(m, k, 1)).blocked_autorange(
            min_run_time=0.5).median
        out.append((f"{m} x {k} x {n}", flops / mm / 1e9, flops / conv / 1e9))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--steps", type=int, default=12, help="timed steps after 3 warm-up steps (default 12)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        p.error("--steps and --threads must be positive")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, ResNet-18 (CIFAR, batch 32), native gradients\n")
    print("| layer | per step | forward (ms) | backward (ms) | backward / forward |")
    print("|---|---|---|---|---|")
    fwd = bwd = 0.0
    for r in in_step(args.steps):
        fwd, bwd = fwd + r["fwd"] * r["per_step"], bwd + r["bwd"] * r["per_step"]
        print(f"| {r['layer']} | {r['per_step']} | {r['fwd'] * 1e3:.2f} | {r['bwd'] * 1e3:.2f} | "
              f"{r['bwd'] / r['fwd']:.2f} |")
    print(f"| all convs, per step | | {fwd * 1e3:.1f} | {bwd * 1e3:.1f} | {bwd / fwd:.2f} |\n")
    print("| M x K x N | torch.mm (GFLOP/s) | as a 1x1 conv1d (GFLOP/s) |")
    print("|---|---|---|")
    for shape, mm, conv in gemm_rates(args.threads):
        print(f"| {shape} | {mm:.0f} | {conv:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
